"""A/B of the Mosaic GPU residual decode: the working tree's kernel against an older copy.

Each variant times `mgpu_residual_decode` at B=64, L=2k (the engine's decode) and B=32, L=8k
(issue 4's point) with `bench_kernels.sweep_decode` (CUPTI sums of every kernel of a call,
medians), the two versions alternating twice so that run-to-run drift shows. Writes
$OUT/ab_mgpu.json. The older copy is an ignored file, carried to the GPU machine by name:

    git show REV:forkjax/pallas_kernels/mgpu_decode.py > scripts/ab_old_mgpu.py
    # device tool: carry ["scripts/ab_old_mgpu.py"], then
    PYTHONPATH=. python3 scripts/ab_mgpu.py '[{}, {"stages": 2}]'   # kernel kwargs per variant
"""

import json
import os
import sys

import ab_old_mgpu as old
import bench_kernels as bk
from forkjax.pallas_kernels import mgpu_decode as new

cfgs = [{k: tuple(v) if isinstance(v, list) else v for k, v in c.items()}  # (jit: hashable)
        for c in (json.loads(sys.argv[1]) if len(sys.argv) > 1 else [{}])]
out = {}
for rep in range(2):
    for name, mod in (("old", old), ("new", new)):
        bk.mgpu_residual_decode = mod.mgpu_residual_decode
        for B, L in ((64, 2048), (32, 8192)):
            for ms, cfg in bk.sweep_decode(B, L, cfgs, "mgpu_residual", 4.3e12):
                out.setdefault(f"{name} B={B} L={L} {json.dumps(cfg)}", []).append(ms * 1e3)
for k, v in sorted(out.items(), key=lambda kv: kv[0][4:] + kv[0][:3]):
    print(f"{k:50s} " + " ".join(f"{x:7.1f}" for x in v))
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "ab_mgpu.json"), "w"), indent=1)
