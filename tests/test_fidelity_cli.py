"""`python -m forkjax.fidelity` (forkjax/fidelity/): on a tiny HF checkpoint with PEFT adapters
and tasks given as token ids it writes its files, `prefix` (served with sharing) equals exact,
a policy that reads another agent's K/V does not, every interval holds its mean, and bad task
lines and flags are clear errors; the answer checks on text; runs merge, with or without
matplotlib."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from forkjax.fidelity.__main__ import main, parse_args
from forkjax.fidelity.tasks import correct, load_tasks
from forkjax.tokenizer import ByteTokenizer


def _tasks(path, names, rng):
    """Two contexts, each written by one agent and read by both: 3 tasks a reader, a third
    with an answer (ids, exact check)."""
    lines = []
    for c in range(2):
        context = rng.integers(3, 200, 48).tolist()
        writer = names[c % len(names)]
        for reader in names:
            for k in range(3):
                task = {"context": context, "task": rng.integers(3, 200, 6).tolist(),
                        "writer": writer, "reader": reader}
                if k % 2:
                    task["answer"] = rng.integers(3, 200, 3).tolist()
                lines.append(json.dumps(task))
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def test_fidelity_cli_on_peft_adapters(hf_suite, tmp_path):
    base, adapters = hf_suite["llama"]
    names = ["qkvo8", "all4rs"]
    n = _tasks(tmp_path / "tasks.jsonl", names, np.random.default_rng(0))
    out = tmp_path / "out"
    result = main(["--model", base, *[a for name in names for a in ("--lora", f"{name}={adapters[name]}")],
                   "--prompts", str(tmp_path / "tasks.jsonl"), "--policies", "forkkv,full_reuse,base",
                   "--max-new-tokens", "4", "--no-progress", "--out", str(out)])
    assert {"fidelity.json", "fidelity.png", "layer_cosine.png"} <= set(os.listdir(out))
    assert json.loads((out / "fidelity.json").read_text())["policies"].keys() == result["policies"].keys()
    assert list(result["policies"]) == ["prefix", "forkkv", "full_reuse", "base"]
    assert result["tasks"] == n and result["scored_tasks"] == n // 3
    prefix = result["policies"]["prefix"]
    # Served, a reader's later tasks read the context's K/V its first task computed, in other
    # chunks than alone: float32 rounding (logits within the parity tests' 1e-4), nothing more.
    assert prefix["kl"] < 1e-6 and prefix["greedy_agreement"] == 1.0 and prefix["top1"] == 1.0
    assert prefix["accuracy"] == result["exact_accuracy"] and prefix["accuracy_vs_prefix"]["mean"] == 0
    assert min(prefix["layer_cosine"]) > 1 - 1e-6
    # Readers of the other agent's base K/V (or merged K/V) move; no adapter at all moves most.
    for name in ("forkkv", "full_reuse", "base"):
        assert result["policies"][name]["kl"] > 1e-6, name
    for m in result["policies"].values():
        for key in ("kl", "top1", "greedy_agreement", "accuracy"):
            lo, hi = m[f"{key}_ci"]
            assert lo <= m[key] <= hi, (key, m)
        assert all(lo <= v <= hi for v, (lo, hi) in zip(m["layer_cosine"], m["layer_cosine_ci"]))
        assert m["tasks"] == n and len(m["layer_cosine"]) == 3  # embeddings + 2 layers


def test_without_an_adapter_effect_every_policy_is_exact(hf_suite, tmp_path):
    """--lora-scale 0: every adapter's B is zero, so every agent is the base model and sharing
    another agent's K/V changes nothing: every policy, `base` included, agrees with exact."""
    base, adapters = hf_suite["llama"]
    names = ["qkvo8", "all4rs"]
    _tasks(tmp_path / "tasks.jsonl", names, np.random.default_rng(1))
    result = main(["--model", base, *[a for name in names for a in ("--lora", f"{name}={adapters[name]}")],
                   "--prompts", str(tmp_path / "tasks.jsonl"), "--policies", "forkkv,full_reuse,base",
                   "--lora-scale", "0", "--max-new-tokens", "4", "--no-progress", "--out", str(tmp_path)])
    assert result["lora_scale"] == 0
    for name, m in result["policies"].items():
        assert m["kl"] < 1e-6 and m["greedy_agreement"] == 1.0 and m["top1"] == 1.0, name


def test_a_scaled_adapter_scales_its_update(hf_suite):
    from forkjax.config import ModelConfig
    from forkjax.lora.peft import load_peft_adapter
    base, adapters = hf_suite["llama"]
    cfg = ModelConfig.from_hf(json.loads(open(os.path.join(base, "config.json")).read()))
    a = load_peft_adapter("q", adapters["qkvo8"], cfg)
    half = a.scaled(0.5)
    for key, (A, B) in a.weights.items():
        assert half.weights[key][0] is A and np.array_equal(half.weights[key][1], B * np.float32(0.5))
    assert half.scaling == a.scaling / 2 and half.name == a.name


@pytest.mark.parametrize("line, match", [
    ("not json", ":2:"),
    ('{"context": [1, 2], "task": [3], "writer": "a", "reader": "nobody"}', ":2: reader 'nobody'"),
    ('{"context": [1, 2], "task": [3], "writer": "a"}', ":2: missing reader"),
    ('{"context": "text", "task": [3], "writer": "a", "reader": "a"}', ":2: context is text"),
    ('{"context": [1, -2], "task": [3], "writer": "a", "reader": "a"}', ":2: context must be"),
    ('{"context": [1], "task": [3], "writer": "a", "reader": "a", "check": "fuzzy"}', ":2: check 'fuzzy'"),
    ('{"context": [1], "task": [3], "writer": "a", "reader": "a", "check": {"regex": "x"}}',
     ":2: check 'regex' reads text"),
    ('{"context": [1], "task": [3], "writer": "a", "reader": "a", "extra": 1}', ":2: unknown field"),
])
def test_bad_task_lines_name_their_line(tmp_path, line, match):
    path = tmp_path / "t.jsonl"
    path.write_text('{"context": [1, 2], "task": [3], "writer": "a", "reader": "a"}\n' + line + "\n")
    with pytest.raises(ValueError, match=match):
        load_tasks(str(path), None, {"a"})


def test_bad_flags_are_refused(tmp_path):
    for argv, match in ((["--lora", "noequals"], "NAME=DIR"), (["--policies", "prefix,nope"], "nope"),
                        ([], "at least one adapter"), (["--lora", "a=x", "--lora", "a=y"], "twice")):
        with pytest.raises(SystemExit):
            parse_args(["--model", "m", "--prompts", "p", *argv])


def test_answer_checks_on_text(tmp_path):
    tok = ByteTokenizer()
    path = tmp_path / "t.jsonl"
    rows = [{"answer": "Paris", "check": "exact"}, {"answer": "Paris", "check": "contains"},
            {"check": {"regex": r"\bP\w+s\b"}}, {"answer": "Paris", "check": {"json": "city.name"}},
            {"answer": '{"a": 1, "b": [2]}', "check": {"json": "."}}]
    path.write_text("".join(json.dumps({"context": "Q:", "task": " capital?", "writer": "a",
                                        "reader": "a", **r}) + "\n" for r in rows))
    exact, contains, regex, field, whole = load_tasks(str(path), tok, {"a"})
    enc = lambda s: tok.encode(s, add_bos=False)  # noqa: E731
    assert correct(exact, enc(" Paris \nmore"), tok) and not correct(exact, enc("Paris, France"), tok)
    assert correct(contains, enc("It is Paris."), tok) and not correct(contains, enc("Lyon"), tok)
    assert correct(regex, enc("Paris"), tok) and not correct(regex, enc("Lyon"), tok)
    assert correct(field, enc('ok {"city": {"name": "Paris"}} done'), tok)
    assert not correct(field, enc('{"city": "Paris"}'), tok) and not correct(field, enc("no json"), tok)
    assert correct(whole, enc('{"b": [2], "a": 1}'), tok) and not correct(whole, enc('{"a": 1}'), tok)
    assert exact.context == tuple(tok.encode("Q:")) and exact.prompt[-len(" capital?"):] == enc(" capital?")


def _result(rng, n, policies, **over):
    """A fidelity.json of `n` random task rows per policy."""
    rows = {p: [dict(kl=float(rng.random()), top1=float(rng.random()), greedy_agreement=float(rng.integers(2)),
                     accuracy=float(rng.integers(2)), layer_cosine=rng.random(3).tolist(), line=i + 1)
                for i in range(n)] for p in policies}
    return dict(model="m", adapters={"a": "A"}, lora_scale=1.0, dtype="float32", prompts="t.jsonl",
                tasks=n, scored_tasks=n, command="cmd", exact_accuracy=0.5, per_task=rows) | over


def test_merge_summarizes_the_runs_tasks_together(tmp_path):
    from forkjax.fidelity.merge import main as merge_main, merge
    from forkjax.fidelity.metrics import summarize
    rng = np.random.default_rng(0)
    runs = [_result(rng, 5, ["prefix", "forkkv", "base"]), _result(rng, 7, ["prefix", "forkkv"], exact_accuracy=0.25)]
    for i, r in enumerate(runs):
        os.makedirs(tmp_path / f"r{i}")
        (tmp_path / f"r{i}" / "fidelity.json").write_text(json.dumps(r))
    result = merge_main([str(tmp_path / "r0"), str(tmp_path / "r1"), "--out", str(tmp_path / "m")])
    assert list(result["policies"]) == ["prefix", "forkkv"] and result["tasks"] == 12  # base: one run only
    rows = runs[0]["per_task"]["forkkv"] + runs[1]["per_task"]["forkkv"]
    assert result["policies"]["forkkv"]["kl"] == summarize(rows)["kl"]
    diff = np.mean([r["accuracy"] for r in rows]) - np.mean(
        [r["accuracy"] for r in runs[0]["per_task"]["prefix"] + runs[1]["per_task"]["prefix"]])
    got = result["accuracy_differences"]["forkkv - prefix"]
    assert got["tasks"] == 12 and abs(got["mean"] - diff) < 1e-12 and got["ci"][0] <= got["mean"] <= got["ci"][1]
    assert result["exact_accuracy"] == (0.5 * 5 + 0.25 * 7) / 12
    assert {"fidelity.json", "fidelity.png"} <= set(os.listdir(tmp_path / "m"))
    with pytest.raises(ValueError, match="differ in lora_scale"):
        merge([runs[0], dict(runs[1], lora_scale=0.5)])


def test_merge_without_matplotlib_writes_the_numbers(tmp_path, monkeypatch, capsys):
    """A serving install has no matplotlib: the run keeps its numbers and says why no plots."""
    from forkjax.fidelity.merge import main as merge_main
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises
    os.makedirs(tmp_path / "r0")
    (tmp_path / "r0" / "fidelity.json").write_text(json.dumps(_result(np.random.default_rng(1), 4, ["prefix"])))
    result = merge_main([str(tmp_path / "r0"), "--out", str(tmp_path / "m")])
    assert result["tasks"] == 4 and os.listdir(tmp_path / "m") == ["fidelity.json"]
    assert "no plots: matplotlib is not installed" in capsys.readouterr().out
