"""Does the jitted step update the donated KV pools in place? Prints XLA's memory analysis.

    PYTHONPATH=. python3 scripts/diag_pool_copies.py [--pool-gb 8]

For each policy and attention implementation (Pallas kernels vs plain-jnp references) it
compiles one decode and one extend step of tiny-llama over a pool of --pool-gb and reports the
temporary bytes XLA needs: about 0 when the pools are updated in place, about one pool (or
more) when XLA copies them.
"""

import argparse
import json

import jax

import forkjax
from forkjax.engine.input_batch import dummy_inputs
from forkjax.engine.model_runner import _step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pool-gb", type=float, default=8)
    args = ap.parse_args()
    rows = []
    for policy in ("forkkv", "prefix"):
        e = forkjax.Engine.from_pretrained("tiny-llama", dtype="bfloat16", cache_policy=policy,
                                           max_batch_size=4, max_prefill_tokens=64, max_model_len=512,
                                           kv_cache_bytes=int(args.pool_gb * 1e9), warmup=False)
        r = e.runner
        for use_pallas in ((True, False) if jax.default_backend() == "gpu" else (False,)):
            for kind, b, c in (("decode", 4, 1), ("extend", 1, 64)):
                inputs, _ = dummy_inputs(b, c, r.buckets.width(1), r.num_slots, r.fanout)
                m = _step.lower(r.graphdef, r.state_def, r.state_leaves, r.pools, inputs, r.prev_tokens,
                                kind=kind, all_logits=False, hidden=False, residual=r.residual,
                                use_pallas=use_pallas).compile().memory_analysis()
                row = dict(policy=policy, pallas=use_pallas, kind=kind, pool_GB=r.layout.nbytes / 1e9,
                           temp_GB=m.temp_size_in_bytes / 1e9, alias_GB=m.alias_size_in_bytes / 1e9)
                rows.append(row)
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
