"""Adapters loaded, replaced and unloaded while the server runs (serve_utils.py); bad adapter
directories refused; residual fan-out to named agents."""

from __future__ import annotations

import json
import pickle
import threading
import time

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from serve_utils import complete, sse_events, write_peft


def test_load_use_replace_unload_adapter(server, tmp_path):
    def hello(model=None):
        return complete(http, model=model, prompt="hello", max_tokens=8, ignore_eos=True)["choices"][0]["text"]

    with server.http() as http:
        base = hello()
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "fresh", "lora_path": str(write_peft(tmp_path / "a"))})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'fresh' added successfully."
        assert "fresh" in {m["id"] for m in http.get("/v1/models").json()["data"]}
        first = hello("fresh")
        assert first != base
        again = http.post("/v1/load_lora_adapter", json={"lora_name": "fresh", "lora_path": str(tmp_path)})
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        replaced = http.post("/v1/load_lora_adapter", json={
            "lora_name": "fresh", "lora_path": str(write_peft(tmp_path / "b", seed=7)), "load_inplace": True})
        assert replaced.status_code == 200
        second = hello("fresh")
        assert second != first  # new weights, and not the old adapter's cached K/V
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "fresh"})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'fresh' removed successfully."
        gone = http.post("/v1/completions", json={"model": "fresh", "prompt": "hello"})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        again = http.post("/v1/unload_lora_adapter", json={"lora_name": "fresh"})
        assert again.status_code == 404


def test_activated_lora_adapter_needs_its_invocation_in_the_prompt(server, tmp_path):
    invocation = [67, 114, 105]
    path = write_peft(tmp_path / "alora", alora_invocation_tokens=invocation)
    with server.http() as http:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "alora-critic", "lora_path": str(path)})
        assert r.status_code == 200, r.text
        bad = http.post("/v1/completions", json={"model": "alora-critic", "prompt": [40, 41, 67, 114, 42]})
        error = bad.json()["error"]
        assert bad.status_code == 400 and error["param"] == "prompt"
        assert "'alora-critic'" in error["message"] and str(invocation) in error["message"]
        good = complete(http, model="alora-critic", prompt=[40, 67, 114, 105, 41], max_tokens=4,
                        ignore_eos=True)
        assert good["usage"]["completion_tokens"] == 4
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "alora-critic"}).status_code == 200


def test_unload_waits_for_running_requests_and_others_keep_flowing(server, tmp_path):
    with server.http() as http:
        assert http.post("/v1/load_lora_adapter", json={
            "lora_name": "busy", "lora_path": str(write_peft(tmp_path / "busy", seed=3))}).status_code == 200
    times, result = {}, {}

    def long_stream():
        with server.http() as http, http.stream("POST", "/v1/completions", json={
                "model": "busy", "prompt": "go", "max_tokens": 300, "ignore_eos": True, "stream": True,
                "temperature": 0, "return_token_ids": True}) as r:
            lines = r.iter_lines()
            times["first"] = time.time()
            events = sse_events(lines)
        times["stream_end"] = time.time()
        result["tokens"] = sum(len(e["choices"][0]["token_ids"]) for e in events)
        result["reason"] = events[-1]["choices"][0]["finish_reason"]

    t = threading.Thread(target=long_stream)
    t.start()
    while "first" not in times:
        time.sleep(0.01)
    unload = {}

    def unload_busy():
        with server.http() as http:
            unload["r"] = http.post("/v1/unload_lora_adapter", json={"lora_name": "busy"})
        unload["t"] = time.time()

    u = threading.Thread(target=unload_busy)
    u.start()
    with server.http() as http:
        other = complete(http, model="planner", prompt="meanwhile", max_tokens=4)
        other_done = time.time()
    t.join(120)
    u.join(120)
    assert result == {"tokens": 300, "reason": "length"}  # the running request finished whole
    assert unload["r"].status_code == 200 and unload["t"] >= times["stream_end"] - 0.5
    assert other["choices"][0]["finish_reason"] in ("stop", "length") and other_done < times["stream_end"]


@pytest.mark.parametrize("case", ["missing", "no_config", "bad_json", "corrupt", "pickled",
                                  "other_base", "rank_too_big", "not_lora", "nan"])
def test_bad_adapter_dirs_are_refused(server, tmp_path, case):
    path = tmp_path / case
    marker = tmp_path / "unpickled"
    if case == "missing":
        path = tmp_path / "nowhere"
    elif case == "no_config":
        path.mkdir()
    elif case == "bad_json":
        write_peft(path)
        (path / "adapter_config.json").write_text("{not json")
    elif case == "corrupt":
        write_peft(path)
        (path / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage" * 10)
    elif case == "pickled":
        write_peft(path)
        (path / "adapter_model.safetensors").unlink()
        (path / "adapter_model.bin").write_bytes(pickle.dumps(_Trap(str(marker))))
    elif case == "other_base":
        write_peft(path, hidden=96, kv=48)
    elif case == "rank_too_big":
        write_peft(path, r=64)
    elif case == "not_lora":
        write_peft(path)
        (path / "adapter_config.json").write_text(json.dumps({"peft_type": "PREFIX_TUNING", "r": 8}))
    elif case == "nan":
        write_peft(path)
        tensors = load_file(str(path / "adapter_model.safetensors"))
        tensors["base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight"][1, 5] = np.nan
        save_file(tensors, str(path / "adapter_model.safetensors"))
    with server.http() as http:
        before = http.get("/v1/models").json()["data"]
        r = http.post("/v1/load_lora_adapter", json={"lora_name": f"bad-{case}", "lora_path": str(path)})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "lora_path"
        expect = {"missing": "not a directory", "no_config": "adapter_config.json", "bad_json": "JSON",
                  "corrupt": "safetensors", "pickled": "pickle", "other_base": "another model",
                  "rank_too_big": "rank", "not_lora": "peft_type",
                  "nan": "layers.2.self_attn.q_proj.lora_A.weight has 1 non-finite"}[case]
        assert expect in error["message"], error["message"]
        assert http.get("/v1/models").json()["data"] == before
    assert not marker.exists()  # the pickle was never unpickled


class _Trap:
    """Unpickling this creates a file: proof that a pickle was loaded."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")




def test_fanout_writes_the_named_agents_residuals(forkkv_server):
    """After planner's request writes coder's residual, coder's request on that prompt computes only
    its tail; critic's, not named, computes its whole prompt. Without the field the server's
    default fan-out writes every adapter's, and each later agent's `usage` reports the cached
    prompt tokens."""
    computed = "forkjax:prefill_tokens_computed_total"

    def cost(model, prompt, **extra) -> tuple[float, int]:
        before = forkkv_server.metrics()[computed]
        usage = complete(http, model=model, prompt=prompt, max_tokens=2, **extra)["usage"]
        return forkkv_server.metrics()[computed] - before, usage["prompt_tokens_details"]["cached_tokens"]

    page = 16
    named, every = "The plan the coder reads next, one page and more.", "Every agent reads this prompt again."
    with forkkv_server.http() as http:
        assert cost("planner", named, fanout_adapters=["coder"], session_id="wf")[0] >= len(named)
        assert cost("coder", named, session_id="wf")[0] < page
        assert cost("critic", named)[0] >= len(named) - page
        n = len(every) + 1  # the prompt's bytes and BOS
        ran, cached = cost("planner", every)
        assert ran + cached == n and cached <= 1  # BOS at most (another's hit, in part of a page)
        whole = n // page * page  # the residuals fan-out wrote: the prompt's whole pages
        for agent in ("coder", "critic"):
            assert cost(agent, every) == (n - whole, whole)
        before = forkkv_server.metrics()
        r = http.post("/v1/completions", json={"model": "planner", "prompt": every, "fanout_adapters": ["nope"]})
        assert r.status_code == 404 and r.json()["error"]["param"] == "fanout_adapters"
        assert r.json()["error"]["code"] == "model_not_found"
    after = forkkv_server.metrics()
    assert after["forkjax:prompt_tokens_total"] == before["forkjax:prompt_tokens_total"]  # nothing queued
