"""Leave-one-out timing of residual decode without its K LoRA term, over pipeline depths.

    cd scripts && PYTHONPATH=.. python3 diag_no_k_lora.py

What the decode kernel's loop costs once the K reconstruction is gone (the floor of any
formulation that takes the K LoRA term out of the loop). Outputs are wrong on purpose
(`skip_k_lora`); a diagnostic, not a benchmark.
"""
import sys

sys.argv = [sys.argv[0]]  # bench_kernels parses no flags when imported
import bench_kernels as bk  # noqa: E402

cfgs = [dict(block_k=64, num_warps=4, num_stages=ns, swap_ab=sw) for sw in (True, False)
        for ns in (2, 3, 4)]
bk.diag_decode(32, 8192, cfgs, 4.3e12)
bk.diag_decode(64, 2048, cfgs[:3], 4.3e12)
