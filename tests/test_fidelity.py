"""scripts/bench_fidelity.py --quick on SmolLM2-135M-Instruct and its trained agents: every
policy runs, the JSON and plots are written, exact is exact against itself, and `forkkv` (own
residuals over another agent's base) stays closer to exact than `full_reuse` (another agent's
whole K/V)."""

import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_quick_fidelity_run(tmp_path):
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_fidelity.py"), "--quick",
                          "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads((tmp_path / "fidelity.json").read_text())
    pol = result["policies"]
    assert set(pol) == {"prefix", "prefix/shared-a", "forkkv", "forkkv+fanout", "full_reuse", "lrshared"}
    layers = 30 + 1
    for name, m in pol.items():
        assert 0 <= m["accuracy"] <= 1 and m["kl"] >= 0 and len(m["layer_cosine"]) == layers, name
        assert m["tasks"] == 6, name  # 2 readers x 3 questions
    for exact in ("prefix", "prefix/shared-a"):
        assert pol[exact]["kl"] == 0 and pol[exact]["top1"] == 1 and pol[exact]["greedy_agreement"] == 1
    assert pol["forkkv"]["kl"] < pol["full_reuse"]["kl"]
    assert pol["forkkv"]["layer_cosine"][-1] > pol["full_reuse"]["layer_cosine"][-1]
    assert {(r["policy"], r["context"]) for r in result["sweep"]} == {(p, 1024) for p in pol}
    assert (tmp_path / "fidelity.png").stat().st_size > 0 and (tmp_path / "layer_cosine.png").stat().st_size > 0
