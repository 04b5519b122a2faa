"""Paged attention over the KV pools: the public functions, and the only module that picks the
backend that runs them (registry.py).

Backends, by name:
    "mosaic"     mosaic.py, warp-specialised Mosaic GPU decode (residual decode only); with
                 mosaic_operands.py, its Triton operand and epilogue kernels
    "triton"     triton.py, one Pallas Triton kernel for decode and extend
    "reference"  reference.py, plain jnp, float32: the contract

backend=None (automatic): residual decode takes "mosaic" where jax runs on a GPU, compiled
(interpret=False), and for shapes `mosaic.supports`; everything else "triton" (on the CPU
only interpreted: `interpret=True`, the Triton interpreter being the reliable one). The
reference runs only when named (the engine's `use_pallas=False`). A backend named for a call
it does not support, or a name the op does not have, raises a ValueError.

config: the kernel options, one frozen object per backend: `TritonConfig` (triton.py) or
`MosaicConfig` (mosaic.py), whose None fields take the tuned defaults for the call's shapes and
device (`resolve`; config=None: every default). A config picks its backend: with backend=None a
TritonConfig runs "triton" and a MosaicConfig "mosaic" (a ValueError where Mosaic does not
support the call); a config of another class than the named backend takes (the reference takes
none) raises a ValueError.

interpret: run the kernels in Pallas' interpreter (False, the default: compiled); None: where
jax has no GPU.

Arguments (see reference.py for the contract): head-major base pools [Hkv, P, S, D], or
[L, Hkv, P, S, D] with `layer` (an int32 scalar: no layer is sliced out of the pool, which XLA
would copy); residual pools [Pr, S, R] or [L, Pr, S, R]; page tables [B, M] int32, entries past
a sequence valid page ids (0, the sink); B_k, B_v [A, R, Hkv, D] with the LoRA scale folded in;
inv_freq [D/2] float32. For zero-copy calls D and R are powers of two >= 16 (pad R with zero
columns of A and zero rows of B): other sizes are zero-padded, a copy of the pools.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from forkjax.pallas_kernels.paged_attention import mosaic, mosaic_operands, triton
from forkjax.pallas_kernels.paged_attention.mosaic import MosaicConfig
from forkjax.pallas_kernels.paged_attention.reference import (
    residual_attention_decode_reference,
    residual_attention_extend_reference,
    unified_attention_decode_reference,
    unified_attention_extend_reference,
)
from forkjax.pallas_kernels.paged_attention.triton import TritonConfig
from forkjax.pallas_kernels.registry import Backend, Call, Registry
from forkjax.pallas_kernels.tuning import on_gpu

__all__ = [
    "residual_attention_decode", "residual_attention_extend", "unified_attention_decode",
    "unified_attention_extend", "residual_attention_decode_reference",
    "residual_attention_extend_reference", "unified_attention_decode_reference",
    "unified_attention_extend_reference", "fused_decode_supported", "fused_decode_operands",
    "fused_residual_decode", "BACKENDS", "backend_for", "TritonConfig", "MosaicConfig",
]


def _interpret(interpret: bool | None) -> bool:
    return not on_gpu() if interpret is None else interpret


def _call(q, k_base, k_res, interpret, config) -> Call:
    """The static facts the checks read: Hq, Hkv, D, page size, R (0: unified), pool dtype."""
    facts = dict(Hq=q.shape[-2], Hkv=k_base.shape[-4], D=k_base.shape[-1],
                 page=k_base.shape[-2], R=0 if k_res is None else k_res.shape[-1],
                 dtype=jnp.dtype(k_base.dtype))
    return Call(interpret=_interpret(interpret), facts=facts, config=config)


def _mosaic_supports(call: Call) -> bool:
    return mosaic.supports(*call.facts.values(), config=call.config)


def _mosaic_preferred(call: Call) -> bool:
    return call.gpu and not call.interpret and _mosaic_supports(call)


def _reference(fn):
    """A reference function as a backend: it takes no kernel options."""
    def run(*args, sm_scale, layer, **_kernel_options):
        return fn(*args, sm_scale=sm_scale, layer=layer)
    return run


def _ops(op: str, triton_fn, reference_fn, **more: Backend) -> Registry:
    """An op's registry: Triton (automatic, after the backends in `more`) and its reference."""
    return Registry(op, (*more, "triton"), **more,
                    triton=Backend(triton_fn, config=TritonConfig),
                    reference=Backend(_reference(reference_fn)))


BACKENDS = {
    "residual_attention_decode": _ops(
        "residual_attention_decode", triton.residual_decode, residual_attention_decode_reference,
        mosaic=Backend(mosaic.mgpu_residual_decode, _mosaic_supports, _mosaic_preferred,
                       config=MosaicConfig)),
    "residual_attention_extend": _ops(
        "residual_attention_extend", triton.residual_extend, residual_attention_extend_reference),
    "unified_attention_decode": _ops(
        "unified_attention_decode", triton.unified_decode, unified_attention_decode_reference),
    "unified_attention_extend": _ops(
        "unified_attention_extend", triton.unified_extend, unified_attention_extend_reference),
}


def backend_for(op: str, q, k_base, k_res=None, *, backend: str | None = None,
                interpret: bool | None = False,
                config: TritonConfig | MosaicConfig | None = None) -> str:
    """The name of the backend that runs `op` (a key of BACKENDS) for arrays (or
    ShapeDtypeStructs) of these shapes and these options."""
    return BACKENDS[op].choose(backend, _call(q, k_base, k_res, interpret, config))


def _run(op, backend, q, k_base, k_res, *args, interpret, config, **options):
    call = _call(q, k_base, k_res, interpret, config)
    return BACKENDS[op](backend, call)(*args, interpret=call.interpret, config=config, **options)


_STATIC = ("backend", "sm_scale", "interpret", "config")


@functools.partial(jax.jit, static_argnames=_STATIC)
def residual_attention_decode(
    q,  # [B, Hq, D]      current token's query, RoPE applied
    k_base,  # [Hkv, P, S, D]  base keys (RoPE applied); [L, Hkv, P, S, D] with `layer`
    v_base,  # [Hkv, P, S, D]
    k_res,  # [Pr, S, R]      residual key activations xA_k (no RoPE); [L, Pr, S, R] with `layer`
    v_res,  # [Pr, S, R]
    base_pages,  # [B, M] int32
    res_pages,  # [B, M] int32
    lengths,  # [B] int32       tokens to attend, the current one included (already written)
    b_k,  # [A, R, Hkv, D]  LoRA scale folded in, zero-padded ranks
    b_v,  # [A, R, Hkv, D]
    adapter_ids,  # [B] int32
    inv_freq,  # [D//2] float32
    *,
    backend=None,  # "mosaic", "triton", "reference" or None (the module docstring)
    sm_scale=None,
    interpret=False,
    layer=None,  # int32 scalar: index of the layer when the pools carry a leading L axis
    config: TritonConfig | MosaicConfig | None = None,  # kernel options (the module docstring)
):
    """ResidualAttention (ForkKV Alg. 1) for one new token per request -> [B, Hq, D]: attention
    over K = bK + RoPE(rK B_k), V = bV + rV B_v of each request's adapter."""
    lengths = lengths.astype(jnp.int32)
    return _run("residual_attention_decode", backend, q, k_base, k_res, q, k_base, v_base, k_res,
                v_res, base_pages, res_pages, lengths, b_k, b_v, adapter_ids, inv_freq,
                sm_scale=sm_scale, interpret=interpret, layer=layer, config=config)


@functools.partial(jax.jit, static_argnames=_STATIC)
def residual_attention_extend(
    q,  # [B, T, Hq, D]   queries of the new tokens, RoPE applied, padded per request
    k_base,  # [Hkv, P, S, D]  (new tokens already written)
    v_base,  # [Hkv, P, S, D]
    k_res,  # [Pr, S, R]
    v_res,  # [Pr, S, R]
    base_pages,  # [B, M] int32
    res_pages,  # [B, M] int32
    prefix_lengths,  # [B] int32   cached tokens before the chunk
    chunk_lengths,  # [B] int32    new tokens in the chunk (<= T)
    b_k,  # [A, R, Hkv, D]
    b_v,  # [A, R, Hkv, D]
    adapter_ids,  # [B] int32
    inv_freq,  # [D//2] float32
    *,
    backend=None,
    sm_scale=None,
    interpret=False,
    layer=None,
    config: TritonConfig | None = None,
):
    """ResidualAttention for a chunk of new tokens per request (causal) -> [B, T, Hq, D]; rows
    past a request's chunk are zero."""
    return _run("residual_attention_extend", backend, q, k_base, k_res, q, k_base, v_base, k_res,
                v_res, base_pages, res_pages, prefix_lengths, chunk_lengths, b_k, b_v,
                adapter_ids, inv_freq, sm_scale=sm_scale, interpret=interpret, layer=layer,
                config=config)


@functools.partial(jax.jit, static_argnames=_STATIC)
def unified_attention_decode(
    q,  # [B, Hq, D]
    k_pages,  # [Hkv, P, S, D] merged keys (RoPE applied); [L, Hkv, P, S, D] with `layer`
    v_pages,  # [Hkv, P, S, D]
    page_table,  # [B, M] int32
    lengths,  # [B] int32
    *,
    backend=None,
    sm_scale=None,
    interpret=False,
    layer=None,
    config: TritonConfig | None = None,
):
    """Plain paged GQA decode over a merged cache (`prefix` / `full_reuse`) -> [B, Hq, D]."""
    return _run("unified_attention_decode", backend, q, k_pages, None, q, k_pages, v_pages,
                page_table, lengths, sm_scale=sm_scale, interpret=interpret, layer=layer,
                config=config)


@functools.partial(jax.jit, static_argnames=_STATIC)
def unified_attention_extend(
    q,  # [B, T, Hq, D]
    k_pages,  # [Hkv, P, S, D]
    v_pages,  # [Hkv, P, S, D]
    page_table,  # [B, M] int32
    prefix_lengths,  # [B] int32
    chunk_lengths,  # [B] int32
    *,
    backend=None,
    sm_scale=None,
    interpret=False,
    layer=None,
    config: TritonConfig | None = None,
):
    """Plain paged causal attention for a chunk of new tokens per request -> [B, T, Hq, D]."""
    return _run("unified_attention_extend", backend, q, k_pages, None, q, k_pages, v_pages,
                page_table, prefix_lengths, chunk_lengths, sm_scale=sm_scale,
                interpret=interpret, layer=layer, config=config)


# ----------------------------------------------------------------------------------------------
# The engine's fused residual decode: from the q|k|v GEMM's output to the Mosaic kernel's
# operands and the K/V to write in one Triton kernel (mosaic_operands.decode_operands), the
# write, then the Mosaic kernel on those operands.
# ----------------------------------------------------------------------------------------------


def fused_decode_supported(heads: tuple[int, int, int], page_size: int, rank: int, dtype, *,
                           backend: str | None = None, interpret: bool | None = False) -> bool:
    """Whether a residual decode of these shapes (heads: Hq, Hkv, D) runs fused: where
    `residual_attention_decode` with these options would run the Mosaic kernel and the Triton
    operand kernel's blocks fit the shapes."""
    hq, hkv, d = heads
    shape = jax.ShapeDtypeStruct
    chosen = backend_for("residual_attention_decode", shape((1, hq, d), dtype),
                         shape((hkv, 1, page_size, d), dtype), shape((1, page_size, rank), dtype),
                         backend=backend, interpret=interpret)
    return chosen == "mosaic" and mosaic_operands.supported(hq // hkv, rank, d)


def fused_decode_operands(y, cos, sin, b_q, b_k, adapter_ids, *, heads, cols, dtype,
                          interpret: bool | None = False):
    """One decode token per row, from the q|k|v GEMM's float32 output y [B, C]
    (`models.attention.QKV`: `cols` its column offsets, cos/sin [B, D] each row's RoPE, b_q
    [N, R, Hq * D] or None, b_k [N, R, Hkv, D]) -> (operands, k [B, Hkv, D] roped,
    v [B, Hkv, D], xA_k [B, R], xA_v [B, R]) in `dtype`: the K/V to write, and the query
    operands `fused_residual_decode` takes (q with its LoRA and RoPE, padded, and W)."""
    hq, hkv, _ = heads
    qx, w, k, v, xa_k, xa_v = mosaic_operands.decode_operands(
        y, cos, sin, b_q, b_k, adapter_ids, heads=heads, cols=cols,
        n_q=mosaic.query_rows(hq // hkv, True), dtype=dtype, interpret=_interpret(interpret))
    return (qx, w), k, v, xa_k, xa_v


def fused_residual_decode(operands, k_base, v_base, k_res, v_res, base_pages, res_pages, lengths,
                          b_k, b_v, adapter_ids, inv_freq, *, layer=None,
                          interpret: bool | None = False):
    """`residual_attention_decode` on the Mosaic kernel from `fused_decode_operands`'
    operands (after the K/V write) -> [B, Hq, D] in the operands' dtype."""
    return mosaic.mgpu_residual_decode(
        operands, k_base, v_base, k_res, v_res, base_pages, res_pages, lengths, b_k, b_v,
        adapter_ids, inv_freq, layer=layer, interpret=_interpret(interpret))
