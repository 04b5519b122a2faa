"""The roofline of a serving run (scripts/bench_serving.py): the least time its engine steps could
take on this device, from the engine's step log and two ceilings measured in the same run.

    roofline_s = sum over steps, sum over the step's operations of
                 max(bytes / copy rate, FLOPs / matmul rate)

A step of the log (EngineStats.step_log) has B requests, T tokens computed and A tokens attended,
A being the sum of its rows' ends: a row computing positions s..e-1 reads the K/V of positions
0..e-1. Its two operations:

- weights: the parameter bytes, read once a step (bench_engine.param_bytes: every weight the
  engine holds, the LoRA slots included, but the input embedding table, of which a step reads
  one row a token); FLOPs 2·P·T for the decoder layers' projection weights P, plus 2·V·d·B for
  the LM head, which runs on one position a request (the one it samples), plus, with adapters,
  2·r·(d_in + d_out) a token for each LoRA projection of each layer.
- attention: K/V bytes, (A + T)·kv (the rows read their K/V up to their ends and the step writes
  the T new tokens'; kv is a token's K and V over all layers, plus its residual row under a
  policy with a residual pool); FLOPs 4·L·H·D per query-key pair (QKᵀ and PV, 2·D each, H query
  heads, L layers). A row of c new tokens ending at e attends c·e − c(c−1)/2 pairs (causal). The
  log keeps only the step's sums, so its B rows are taken as equal: pairs = T·A/B − T·(T/B − 1)/2,
  exact for a decode step (c = 1: pairs = A) and for an extend step of one row.

Attention at the matmul rate is a bound no attention kernel reaches: the roofline is the least
time, not a prediction. The rates: the device's copy rate (timing.copy_bandwidth on a GPU, one
elementwise pass over 16 MiB on a CPU) and the rate of one large matmul (8192² bf16 on a GPU,
512² float32 on a CPU), both timed here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import timing  # scripts/ is on sys.path when a script runs
from bench_engine import param_bytes

CPU_COPY_ELEMENTS = 1 << 22  # float32: 16 MiB, past a CPU's caches, timed in a second or so
MATMUL_N = {"gpu": (8192, jnp.bfloat16), "cpu": (512, jnp.float32)}


def measure_rates(log=print) -> dict:
    """The device's copy rate (bytes read + written per second) and matmul rate (FLOP/s). On a
    GPU, call it before building an engine: its buffers need memory the KV pool would take."""
    gpu = jax.default_backend() == "gpu"
    if gpu:
        copy, _, how = timing.copy_bandwidth(log=log)
    else:
        x = jnp.ones(CPU_COPY_ELEMENTS, jnp.float32)
        ms, how = timing.time_ms(jax.jit(lambda a: a + 1.0), (x,), iters=2, log=log)
        copy = 2 * x.nbytes / (ms * 1e-3)
    n, dtype = MATMUL_N["gpu" if gpu else "cpu"]
    a, b = (jax.random.normal(k, (n, n), dtype) for k in jax.random.split(jax.random.key(1)))
    ms, _ = timing.time_ms(jax.jit(lambda x, y: x @ y), (a, b), iters=5, log=log)
    return dict(copy_rate_GBps=copy / 1e9, matmul_rate_TFLOPs=2 * n**3 / (ms * 1e-3) / 1e12,
                matmul_shape=[n, n], matmul_dtype=jnp.dtype(dtype).name, timer=how)


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """Per-step cost coefficients of one engine: bytes and FLOPs as the module docstring says."""
    weight_bytes: float
    layer_params: float  # decoder-layer projection weights (P)
    head_params: float  # the LM head (V·d)
    lora_flops_per_token: float  # 0 without adapters
    kv_bytes_per_token: float
    flops_per_pair: float  # 4·L·H·D

    @classmethod
    def of(cls, engine, lora_rank: int, lora_modules, adapters: int) -> StepCosts:
        cfg, layout = engine.model_cfg, engine.runner.layout
        shapes = cfg.projection_shapes()
        kv = layout.base_page_bytes + (layout.res_page_bytes if layout.policy.uses_residual else 0)
        lora = sum(d_in + d_out for m, (d_in, d_out) in shapes.items() if m in lora_modules)
        return cls(weight_bytes=param_bytes(engine),
                   layer_params=cfg.num_layers * sum(i * o for i, o in shapes.values()),
                   head_params=cfg.vocab_size * cfg.hidden_size,
                   lora_flops_per_token=2 * lora_rank * lora * cfg.num_layers if adapters else 0.0,
                   kv_bytes_per_token=kv / layout.page_size,
                   flops_per_pair=4 * cfg.num_layers * cfg.num_heads * cfg.head_dim)

    def operations(self, requests: int, computed: int, attended: int) -> list[tuple[float, float]]:
        """[(bytes, FLOPs)] of one step's operations: the weights, then attention."""
        gemm = ((2 * self.layer_params + self.lora_flops_per_token) * computed
                + 2 * self.head_params * requests)
        pairs = computed * attended / requests - computed * (computed / requests - 1) / 2
        kv = (attended + computed) * self.kv_bytes_per_token
        return [(self.weight_bytes, gemm), (kv, self.flops_per_pair * pairs)]


def roofline(step_log: list, costs: StepCosts, rates: dict) -> dict:
    """The roofline of the steps of `step_log` (per kind too) and their device seconds."""
    copy, mm = rates["copy_rate_GBps"] * 1e9, rates["matmul_rate_TFLOPs"] * 1e12
    out = dict(roofline_s=0.0, roofline_decode_s=0.0, roofline_extend_s=0.0, device_s=0.0,
               num_steps=len(step_log), total_flops=0.0, total_bytes=0.0)
    for decode, requests, computed, attended, device_s in step_log:
        ops = costs.operations(requests, computed, attended)
        t = sum(max(b / copy, f / mm) for b, f in ops)
        out["roofline_s"] += t
        out["roofline_decode_s" if decode else "roofline_extend_s"] += t
        out["device_s"] += device_s
        out["total_flops"] += sum(f for _, f in ops)
        out["total_bytes"] += sum(b for b, _ in ops)
    return out
