"""The server's engine thread (EngineLoop) and its HTTP app over a scripted engine, without a
model (milliseconds, no JAX): streaming to the sink, refusals, adapter unloads that wait for
running requests, engine failures, aborts, and what reaches the engine from a request."""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
import types

import pytest

from forkjax.cache.policy import salted
from forkjax.engine.sequence import Request, SamplingParams, Sequence, Status
from forkjax.server.engine_loop import EngineLoop, RequestHandle
from forkjax.tokenizer import ByteTokenizer


# ---- the engine thread over a scripted engine -------------------------------------------------

class ScriptedEngine:
    """Every step (2 ms) appends token 7 to each running request; `fail_next` makes one raise.
    Enough of the Engine for create_app too (a byte tokenizer, stats, config)."""

    def __init__(self, cache_policy="forkkv"):
        self.waiting, self.running = collections.deque(), []
        self.adapters = {"a": object(), "b": object()}
        self.fail_next = False
        self.scheduler = self
        self.slots = self
        self.config = types.SimpleNamespace(cache_policy=cache_policy, residual_fanout=False, page_size=16)
        self.tokenizer, self.max_model_len = ByteTokenizer(), 1024
        self.model_cfg = types.SimpleNamespace(vocab_size=512)
        self.added: list[Sequence] = []
        self.flushed_on: list[str] = []  # threads flush_cache ran on

    @property
    def has_work(self):
        return bool(self.waiting or self.running)

    @property
    def by_name(self):
        return {n: type("A", (), {"source": n}) for n in self.adapters}

    def add_request(self, prompt, adapter, params, *, session_id=None, session_end=False,
                    session_tokens=None, session_next_s=None, fanout_adapters=None, cache_salt=None):
        if adapter is not None and adapter not in self.adapters:
            raise KeyError(adapter)
        if not prompt:
            raise ValueError("empty prompt")
        fanout = {n: n for n in fanout_adapters or () if self.by_name[n]}  # KeyError for an unknown one
        # the salt is folded into the cache key (adapter_key), as the engine does
        seq = Sequence(Request(tuple(prompt), adapter, salted(adapter, cache_salt), params,
                               session_id=session_id,
                               session_end=session_end, session_tokens=session_tokens,
                               session_next_s=session_next_s, fanout=tuple(fanout.items())))
        self.waiting.append(seq)
        self.added.append(seq)
        return seq

    def step(self):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("device on fire")
        time.sleep(0.002)
        while self.waiting:
            seq = self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
        for seq in list(self.running):
            seq.output.append(7)
            if len(seq.output) >= seq.params.max_new_tokens:
                self.abort(seq, "length")

    def abort(self, seq, reason="abort"):
        for q in (self.waiting, self.running):
            if seq in q:
                q.remove(seq)
        seq.finish(reason)

    def unload_adapter(self, name):
        assert not any(s.adapter == name or name in s.targets.values() for s in self.running), \
            "unloaded under a running request"
        del self.adapters[name]

    def stats(self):
        return {"base_pages_total": 64, "residual_pages_total": 64}

    def flush_cache(self):
        self.flushed_on.append(threading.current_thread().name)
        return 3


class Collector:
    def __init__(self):
        self.outputs, self.done = [], threading.Event()

    def __call__(self, out):
        self.outputs.append(out)
        if out.finish_reason is not None:
            self.done.set()

    @property
    def tokens(self):
        return sum((o.token_ids for o in self.outputs), [])


def submit(loop, adapter, n, prompt=(1,),
           **fields) -> tuple[Collector, concurrent.futures.Future, RequestHandle]:
    sink = Collector()
    handle = RequestHandle(0, list(prompt), adapter, SamplingParams(max_new_tokens=n), sink, **fields)
    return sink, loop.add([handle]), handle


@pytest.fixture
def loop():
    engine_loop = EngineLoop(ScriptedEngine())
    engine_loop.start()
    yield engine_loop
    engine_loop.shutdown()
    assert not engine_loop.alive


def test_tokens_stream_to_the_sink(loop):
    sink, fut, _ = submit(loop, "a", 5)
    fut.result(5)
    assert sink.done.wait(5)
    assert sink.tokens == [7] * 5 and sink.outputs[-1].finish_reason == "length"
    assert loop.generation_tokens == 5


def test_a_refused_request_queues_nothing(loop):
    good = RequestHandle(0, [1], None, SamplingParams(max_new_tokens=50), Collector())
    bad = RequestHandle(1, [], None, SamplingParams(max_new_tokens=5), Collector())
    with pytest.raises(ValueError):
        loop.add([good, bad]).result(5)
    assert loop.call(lambda: loop.engine.has_work).result(5) is False
    with pytest.raises(KeyError):
        submit(loop, "nope", 1)[1].result(5)


def test_unload_waits_for_running_and_holds_new_requests(loop):
    running, _, _ = submit(loop, "a", 200)
    other, _, _ = submit(loop, "b", 3)
    unloaded = loop.after_drain("a", lambda: loop.engine.unload_adapter("a"))
    _, late_fut, _ = submit(loop, "a", 1)  # arrives while "a" drains: held, then refused
    assert other.done.wait(5) and not running.done.is_set()  # others keep flowing meanwhile
    unloaded.result(10)
    assert running.tokens == [7] * 200 and running.outputs[-1].finish_reason == "length"
    with pytest.raises(KeyError):
        late_fut.result(5)
    assert "a" not in loop.adapters


def test_unload_waits_for_requests_that_fan_out_to_the_adapter(loop):
    # The fan-out writes the slot's weights under the adapter's key: not after the slot changed.
    running, fut, handle = submit(loop, "b", 200, fanout_adapters=["a"])
    fut.result(5)
    assert handle.seq.targets == {"a": "a"}
    unloaded = loop.after_drain("a", lambda: loop.engine.unload_adapter("a"))
    unloaded.result(10)
    assert running.done.is_set() and running.tokens == [7] * 200


def test_an_engine_failure_fails_its_requests_and_the_loop_goes_on(loop):
    loop.call(lambda: setattr(loop.engine, "fail_next", True)).result(5)
    failed, _, _ = submit(loop, "a", 3)
    assert failed.done.wait(5)
    assert failed.outputs[-1].finish_reason == "error" and "on fire" in str(failed.outputs[-1].error)
    after, _, _ = submit(loop, "b", 2)
    assert after.done.wait(5) and after.tokens == [7, 7]


def test_abort_finishes_the_request(loop):
    sink, fut, handle = submit(loop, None, 10**6)
    fut.result(5)
    loop.abort([handle])
    assert sink.done.wait(5) and sink.outputs[-1].finish_reason == "abort"


# ---- the app over the scripted engine ---------------------------------------------------------

@pytest.fixture
def client(loop):
    from fastapi.testclient import TestClient

    from forkjax.server.app import create_app
    app = create_app(loop, model_name="base", model_root="base", api_key="k")
    with TestClient(app, headers={"Authorization": "Bearer k"}) as c:
        yield c


def test_session_salt_and_fanout_reach_every_choice(client, loop):
    r = client.post("/v1/completions", json={"model": "a", "prompt": [[1, 2], [3]], "n": 2, "max_tokens": 2,
                                             "session_id": "wf-1", "fanout_adapters": ["b"],
                                             "cache_salt": "team-a", "session_end": True,
                                             "session_tokens": 900})
    assert r.status_code == 200, r.text
    assert [(s.session_id, s.session_end, s.session_tokens, s.targets, s.adapter_key)
            for s in loop.engine.added] == [("wf-1", True, 900, {"b": "b"}, salted("a", "team-a"))] * 4


def test_bad_fanout_is_refused_before_anything_is_queued(client, loop):
    def error(fanout):
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                      "max_tokens": 2, "fanout_adapters": fanout})
        return r.status_code, r.json()["error"]["param"], r.json()["error"]["code"]

    assert error(["a", "zzz"]) == (404, "fanout_adapters", "model_not_found")
    assert error(["base"]) == (404, "fanout_adapters", "model_not_found")  # the base has no residual
    loop.adapters = {**loop.adapters, "ghost": "x"}  # unloaded between the server's check and the engine's
    assert error(["ghost"]) == (404, "fanout_adapters", "model_not_found")
    loop.engine.config.cache_policy = "prefix"
    assert error(["a"]) == (400, "fanout_adapters", None)
    assert loop.engine.added == []
    none = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "fanout_adapters": []})
    assert none.status_code == 200  # [] is no fan-out, under any policy


def test_flush_cache_runs_on_the_engine_thread_behind_the_key(client, loop):
    assert client.post("/flush_cache", headers={"Authorization": ""}).status_code == 401
    assert client.post("/flush_cache/", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert loop.engine.flushed_on == []
    r = client.post("/flush_cache")
    assert r.status_code == 200 and r.text == "Cache flushed. 3 KV pages freed."
    assert loop.engine.flushed_on == ["forkjax-engine"]
