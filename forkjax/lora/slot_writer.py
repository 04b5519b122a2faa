"""Writing adapters into device slots: one transfer and one program a swap.

An adapter's slot image, its A^T [L, R, d_in] and B [L, R, d_out] per projection it targets, in
the model's dtype and zero-padded to the slots' rank R, is made once, when the adapter is
registered, and kept in pinned host memory on a GPU (jax memory kind `pinned_host`), so a swap does no
host arithmetic: `jax.device_put` starts the image's copy to the device (from pinned memory at
the link's rate, ~49 GB/s on the H200 against 4-7 GB/s from pageable numpy; ~27 MB for a
rank-16 q/k/v/o adapter of Llama-3-8B), and one jitted program that donates every LoRA
projection's stacked weight and B (a handful of arrays, each every layer's) writes it into the
slot's rows in place (zeros into the projections
the adapter does not target, so a slot holds exactly one adapter's function). Both are
dispatched, not waited for: the copy runs beside the step in flight, and the write, ordered
after that step by the donation, before the next one (JAX orders work on a buffer by dispatch).
Under tensor parallelism the image goes to the mesh in the parameters' layout and each shard
writes its own rows (tensor_parallel.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from forkjax.lora.peft import LoraAdapter
from forkjax.lora.slots import BASE_SLOT, check_fits, lora_modules, projection, slot_rank
from forkjax.lora.targets import holder_of
from forkjax.tensor_parallel import REPLICATED, shard, sharding, spec_of


@functools.partial(jax.jit, static_argnums=(4, 5), donate_argnums=(0, 1))
def _write(weights, bs, image, slot, plan, tp: int):
    """`_write_slot`, per shard under tensor parallelism (`tp` > 1; `plan`'s rows are a shard's)."""
    if tp == 1:
        return _write_slot(weights, bs, image, slot, plan)
    w_specs, b_specs = [None] * len(weights), [None] * len(bs)
    for module, _, first_row, wi, bi in plan:
        w_specs[wi] = spec_of(f"layers.lora_a.{module}" if first_row is None
                              else f"layers.{holder_of(module)}.weight")
        b_specs[bi] = spec_of(f"layers.lora_b.{module}")
    specs = (tuple(w_specs), tuple(b_specs))
    return shard(functools.partial(_write_slot, plan=plan), tp, out_specs=specs,
                 in_specs=(*specs, image_specs(image), REPLICATED))(weights, bs, image, slot)


def image_specs(image: dict) -> dict:
    """The PartitionSpecs of a slot image {module: (A^T [L, R, in], B [L, R, out])}: those of one
    layer's lora_a and lora_b (their slot axis is the image's layer axis)."""
    return {m: (spec_of(f"lora_a.{m}"), spec_of(f"lora_b.{m}")) for m in image}


def _write_slot(weights, bs, image, slot, plan):
    """weights (where the A's lie: every LoRA projection's stacked weight [L, O + A rows, in], or
    on the sgmv path every lora_a [L, N, R, in]) and bs (every B [L, N, R, out]) with the slot's
    rows replaced in every layer at once: `plan` holds per module (name, in the image, its
    slot-0 A row in the stacked weight or None for lora_a, weight index, B index); image
    {module: (A^T [L, R, in], B [L, R, out])}."""
    weights, bs = list(weights), list(bs)
    for module, present, first_row, wi, bi in plan:
        w, b = weights[wi], bs[bi]
        layers, r = b.shape[0], b.shape[2]
        a_rows = image[module][0] if present else jnp.zeros((layers, r, w.shape[-1]), w.dtype)
        b_rows = image[module][1] if present else jnp.zeros((layers, r, b.shape[-1]), b.dtype)
        a_rows, b_rows = a_rows.astype(w.dtype), b_rows.astype(b.dtype)
        if first_row is None:
            weights[wi] = jax.lax.dynamic_update_slice_in_dim(w, a_rows[:, None], slot, 1)
        else:
            weights[wi] = jax.lax.dynamic_update_slice_in_dim(w, a_rows, first_row + slot * r, 1)
        bs[bi] = jax.lax.dynamic_update_slice_in_dim(b, b_rows[:, None], slot, 1)
    return tuple(weights), tuple(bs)


class SlotWriter:
    """The slot images of the registered adapters (by name) and the program that writes one
    into a device slot of the LoRA projections of a model of `model`'s structure, in its
    parameters as a flat list (`jax.tree.leaves(nnx.state(model))`: the model runner's)."""

    def __init__(self, model, device=None):
        self.modules, self.rank, self.layers = lora_modules(model), slot_rank(model), model.num_layers
        self.tp = model.tp
        device = device or jax.devices()[0]
        # Pinned memory speeds the copy to a GPU; a CPU's device memory is host memory already.
        self._host = (jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
                      if device.platform == "gpu" else None)
        self._device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
        self._images: dict[str, tuple[str, dict]] = {}  # name -> (content hash, image)
        # The parameters a write replaces (every LoRA projection's stacked weight, then every B:
        # a handful, each holding every layer), as indices into the flat list, the program's
        # plan, and each module's (d_in, d_out, dtype): fixed by the model's structure.
        index = {id(x): i for i, x in enumerate(jax.tree.leaves(nnx.state(model)))}
        weights, bs, plan, self._shapes = [], [], [], {}
        for module in self.modules:
            proj = projection(model, module)
            fused = proj.lora_path == "fused"
            a = index[id((proj.weight if fused else proj.lora_a[module]).get_raw_value())]
            if a not in weights:  # q, k and v share one weight
                weights.append(a)
            plan.append((module, proj.a_rows(module, 0) if fused else None, weights.index(a), len(bs)))
            b = proj.lora_b[module].get_raw_value()
            bs.append(index[id(b)])
            self._shapes[module] = (proj.weight.get_raw_value().shape[-1], b.shape[-1], b.dtype)
        self._leaves, self._num_weights, self._plan = weights + bs, len(weights), tuple(plan)

    def image_bytes(self, name: str) -> int:
        """Bytes of a registered adapter's slot image (what a swap copies)."""
        return sum(a.nbytes + b.nbytes for a, b in self._images[name][1].values())

    def prepare(self, adapter: LoraAdapter) -> None:
        """Make `adapter`'s slot image (replacing one of its name): pinned host memory on a GPU.
        The caller has checked that it fits (slots.check_fits)."""
        image = {}
        for module in sorted(adapter.targets):
            d_in, d_out, dtype = self._shapes[module]
            a = np.zeros((self.layers, self.rank, d_in), np.float32)
            b = np.zeros((self.layers, self.rank, d_out), np.float32)
            for layer in range(self.layers):
                if (layer, module) in adapter.weights:
                    wa, wb = adapter.weights[(layer, module)]  # [in, r], [r, out]
                    a[layer, :wa.shape[1]] = wa.T
                    b[layer, :wb.shape[0]] = wb
            pair = (a.astype(dtype), b.astype(dtype))  # ml_dtypes rounds to nearest even, as XLA does
            image[module] = pair if self._host is None else jax.device_put(pair, self._host)
        self._images[adapter.name] = (adapter.content_hash, image)

    def forget(self, name: str) -> None:
        self._images.pop(name, None)

    def write(self, params: list, slot: int, adapter: LoraAdapter | None) -> list:
        """Write `adapter` (None: zeros) into `slot` of every LoRA projection -> the flat
        parameters `params` with those it replaced (donated: the old ones are gone) new
        (dispatched; the image is made first if `adapter` was not prepared)."""
        if slot == BASE_SLOT and adapter is not None:
            raise ValueError("slot 0 is reserved for the bare base model")
        image = {}
        if adapter is not None:
            if self._images.get(adapter.name, (None,))[0] != adapter.content_hash:
                self.prepare(adapter)
            image = self._images[adapter.name][1]
            where = self._device if self.tp == 1 else {
                m: tuple(sharding(self.tp, spec) for spec in specs) for m, specs in image_specs(image).items()}
            image = jax.device_put(image, where)
        plan = tuple((module, module in image, *rest) for module, *rest in self._plan)
        old = [params[i] for i in self._leaves]
        k = self._num_weights
        new = _write(tuple(old[:k]), tuple(old[k:]), image, jnp.int32(slot), plan, self.tp)
        params = list(params)
        for i, value in zip(self._leaves, new[0] + new[1]):
            params[i] = value
        return params


def write_slot(model, slot: int, adapter: LoraAdapter | None) -> None:
    """Write `adapter` (None: zeros) into `slot` of every LoRA projection of the nnx `model`,
    once (an engine's model runner holds the parameters and the engine a `SlotWriter`, whose
    images outlive a write)."""
    if adapter is not None:
        check_fits(model, adapter)
    leaves, treedef = jax.tree.flatten(nnx.state(model))
    nnx.update(model, jax.tree.unflatten(treedef, SlotWriter(model).write(leaves, slot, adapter)))
