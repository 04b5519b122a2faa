"""scripts/bench_fidelity.py at 1k tokens (python -m forkjax.fidelity on the staff-directory tasks) on
SmolLM2-135M-Instruct and its trained agents: the JSON and plots are written, served `prefix` is
exact, the Activated LoRA agents sharing the directory's base K/V are exact, and `forkkv` (own residuals over another agent's base) stays closer to exact than
`full_reuse` (another agent's whole K/V). Two policies beside `prefix` keep the suite's time:
every policy's engine path has its own tests, and the benchmark's full run covers all five."""

import importlib.util
import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_quick_fidelity_run(tmp_path):
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_fidelity.py"), "--contexts", "512",
                          "--tasks", "2", "--policies", "forkkv,full_reuse", "--alora", "--out", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads((tmp_path / "fidelity.json").read_text())
    pol = result["policies"]
    assert set(pol) == {"prefix", "forkkv", "full_reuse", "alora"}
    # the Activated LoRA agents share the base model's K/V of the directory, exactly
    assert pol["alora"]["kl"] < 1e-6 and pol["alora"]["top1"] == 1 and pol["alora"]["greedy_agreement"] == 1
    layers = 30 + 1
    for name, m in pol.items():
        assert 0 <= m["accuracy"] <= 1 and m["kl"] >= 0 and len(m["layer_cosine"]) == layers, name
        assert m["tasks"] == 4, name  # 2 readers x 2 questions
    # Served `prefix` against each task alone: float32 rounding of other chunkings, nothing more.
    assert pol["prefix"]["kl"] < 1e-6 and pol["prefix"]["top1"] == 1 and pol["prefix"]["greedy_agreement"] == 1
    assert pol["forkkv"]["kl"] < pol["full_reuse"]["kl"]
    assert pol["forkkv"]["layer_cosine"][-1] > pol["full_reuse"]["layer_cosine"][-1]
    assert {(r["policy"], r["context"]) for r in result["sweep"]} == {(p, 512) for p in pol}
    assert (tmp_path / "fidelity.png").stat().st_size > 0 and (tmp_path / "sweep.png").stat().st_size > 0
    assert (tmp_path / "rank8" / "layer_cosine.png").stat().st_size > 0
    for m in pol.values():  # forkjax.fidelity's intervals come along
        assert m["kl_ci"][0] <= m["kl"] <= m["kl_ci"][1]


def test_strength_plot_and_set_labels_for_two_adapter_sets(tmp_path):
    """--scales over a q/k/v/o and a q/v set: each set's curve in strength.png, sets named by
    their rank and targets."""
    spec = importlib.util.spec_from_file_location("bench_fidelity", REPO / "scripts" / "bench_fidelity.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for name, targets in (("qkvo", ["k_proj", "q_proj", "v_proj", "o_proj"]), ("qv", ["v_proj", "q_proj"])):
        (tmp_path / name / "a").mkdir(parents=True)
        (tmp_path / name / "a" / "adapter_config.json").write_text(json.dumps({"r": 8, "target_modules": targets}))
    labels = [bench.set_label({"a": str(tmp_path / name / "a")}) for name in ("qkvo", "qv")]
    assert labels == ["rank8", "rank8-qv"]
    row = dict(kl=0.1, accuracy=0.5)
    result = dict(policies={"prefix": row, "forkkv": row},
                  sweep=[dict(row, policy=p, context=1024, rank=8, set=s) for s in labels for p in ("prefix", "forkkv")],
                  strength=[dict(set=s, scale=x, policy=p, kl=0.01 * x, adapter_kl=x)
                            for s in labels for x in (0.5, 1, 2) for p in ("prefix", "forkkv", "base")])
    bench.plot(result, str(tmp_path))
    assert all((tmp_path / f).stat().st_size > 0 for f in ("fidelity.png", "sweep.png", "strength.png"))
