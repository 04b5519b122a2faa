"""The engine-core process's loop (`EngineCoreProc`) and the front end over it, with a
scripted engine on a thread and real ZeroMQ sockets (milliseconds, no JAX): every message's
round trip, batched outputs, refusals, adapter changes that wait for running requests, engine
failures, aborts, stopping, and the front end when its core dies."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
from scripted_core import Peer, ScriptedCore, ScriptedEngine, front_end

from forkjax.cache.policy import salted
from forkjax.engine.requests import InvalidArgument
from forkjax.sampling_params import SamplingParams
from forkjax.server import messages as m

FOREVER = 10**6  # tokens: such requests run until aborted


@pytest.fixture
def core(tmp_path):
    with ScriptedCore(ScriptedEngine(), tmp_path) as c:
        yield c


@pytest.fixture
def peer(core):
    return Peer(core, 0)


def submit(peer: Peer, rid: int, adapter, n: int, prompts=((1,),), **fields) -> m.Reply:
    choices = [m.Choice(list(p), SamplingParams(max_new_tokens=n)) for p in prompts]
    peer.send(m.Submit(peer.client, rid, rid, choices, adapter=adapter, **fields))
    return peer.reply(rid)


# ---- the messages -----------------------------------------------------------------------------

PARAMS = SamplingParams(max_new_tokens=3, temperature=0.5, stop_token_ids=(2,), logit_bias=((5, -1.5),),
                        logprobs=2)
INFO = m.EngineInfo("m", "forkkv", 1024, 512, 16, 4096, True, ("gguf", "/x.gguf"), {"a": "/a"})
MESSAGES = [
    m.Submit(1, 2, 3, [m.Choice([1, 2], PARAMS)], adapter="a", session_id="s", session_end=True,
             session_tokens=900, session_next_s=1.5, cache_salt="t", fanout_adapters=["b"]),
    m.Abort(1, 3, [0, 2], stop=True), m.Score(1, 4, [1, 2, 3], 5, adapter=None, cache_salt="t"),
    m.LoadAdapter(1, 5, "a", "/p", pinned=True, replace=True), m.UnloadAdapter(1, 6, "a"),
    m.GetStats(1, 7), m.FlushCache(1, 8), m.StopRequests(1), m.Hello(2, "ipc:///tmp/x"), m.Shutdown(1),
    m.Ready(info=INFO), m.Ready(error="bad flags"),
    m.Reply(9, result={"running": 3, "mean": 0.5}), m.Reply(9, error="no", kind="not_found"),
    m.Outputs([m.Output(3, 0, [7, 8], logprobs=[[-0.1, [7, 1], [-0.1, -2.5]]] * 2),
               m.Output(3, 1, [], finish_reason="error", error="boom", kind="error", queued_s=0.25)]),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=[type(x).__name__ for x in MESSAGES])
def test_every_message_round_trips(msg):
    decode = m.decode_request if isinstance(msg, m.Request.__args__) else m.decode_response
    assert decode(m.encode(msg)) == msg


def test_a_message_with_bad_sampling_parameters_is_refused_when_decoded():
    bad = m.encode(m.Submit(0, 1, 1, [m.Choice([1], PARAMS)])).replace(b"\x03", b"\xff", 1)
    with pytest.raises(msgspec.ValidationError, match="max_new_tokens"):
        m.decode_request(bad)


# ---- the core loop ----------------------------------------------------------------------------

def test_tokens_come_back_in_one_outputs_message_a_step(core, peer):
    assert submit(peer, 1, "a", 5, prompts=[(1,), (2,)]).error is None
    outs = peer.until_finished(1, choices=2)
    for index in (0, 1):
        mine = [o for o in outs if o.index == index]
        assert sum((o.token_ids for o in mine), []) == [7] * 5
        assert mine[-1].finish_reason == "length" and mine[-1].queued_s >= 0
    batched = [o for o in outs if o.token_ids]
    assert len(batched) == 10  # both choices' tokens of one step travel together, 5 steps


def test_a_refused_request_queues_nothing(core, peer):
    reply = submit(peer, 1, None, 50, prompts=[(1,), ()])
    assert (reply.kind, reply.error) == ("invalid", "empty prompt")
    assert not core.engine.has_work and [s.status.value for s in core.engine.added] == ["finished"]
    assert submit(peer, 2, "nope", 1).kind == "not_found"


def test_unload_waits_for_running_and_holds_new_requests(core, peer):
    assert submit(peer, 1, "a", 200).error is None
    assert submit(peer, 2, "b", 3).error is None
    peer.send(m.UnloadAdapter(0, 10, "a"))
    peer.send(m.Submit(0, 11, 3, [m.Choice([1], SamplingParams(max_new_tokens=1))], adapter="a"))
    assert peer.until_finished(2)[-1].finish_reason == "length"  # others flow meanwhile
    assert 10 not in peer.replies
    assert peer.reply(10).result == {"b": "b"}
    assert sum((o.token_ids for o in peer.until_finished(1)), []) == [7] * 200
    assert peer.reply(11).kind == "not_found"  # held during the unload, then refused
    peer.send(m.UnloadAdapter(0, 12, "a"))
    assert peer.reply(12).kind == "not_found"


def test_unload_waits_for_requests_that_fan_out_to_the_adapter(core, peer):
    # The fan-out writes the slot's weights under the adapter's key: not after the slot changed.
    assert submit(peer, 1, "b", 200, fanout_adapters=["a"]).error is None
    assert core.engine.added[0].targets == {"a": "a"}
    peer.send(m.UnloadAdapter(0, 10, "a"))
    assert peer.reply(10).error is None
    assert peer.until_finished(1)[-1].finish_reason == "length"


def test_an_engine_failure_fails_its_requests_and_the_loop_goes_on(core, peer):
    core.engine.fail_next = True
    assert submit(peer, 1, "a", 3).error is None
    last = peer.until_finished(1)[-1]
    assert (last.finish_reason, last.kind) == ("error", "error") and "on fire" in last.error
    assert submit(peer, 2, "b", 2).error is None
    assert sum((o.token_ids for o in peer.until_finished(2)), []) == [7, 7]


def test_abort_ends_the_choices_named(core, peer):
    assert submit(peer, 1, None, FOREVER, prompts=[(1,), (2,)]).error is None
    peer.send(m.Abort(0, 1, [1], stop=True))
    peer.until_finished(1, choices=1)
    assert [o.finish_reason for o in peer.outputs if o.finish_reason] == ["stop"]
    peer.send(m.Abort(0, 1))
    assert [o.finish_reason for o in peer.until_finished(1, choices=2) if o.finish_reason] == ["stop", "abort"]


def test_stop_requests_ends_this_front_ends_requests_only(core, peer):
    other = Peer(core, 1)
    assert submit(peer, 1, "a", FOREVER).error is None
    assert submit(other, 1, "b", 5).error is None
    peer.send(m.UnloadAdapter(0, 10, "a"))
    peer.send(m.Submit(0, 11, 2, [m.Choice([1], SamplingParams(max_new_tokens=5))], adapter="a"))  # held
    peer.send(m.StopRequests(0))
    assert peer.until_finished(1)[-1].finish_reason == "shutdown"
    assert peer.reply(11).kind == "shutdown" and peer.reply(10).error is None
    assert submit(peer, 3, "b", 5).kind == "shutdown"
    assert other.until_finished(1)[-1].finish_reason == "length"  # the other front end serves on
    assert submit(other, 2, "b", 1).error is None


def test_calls_run_on_the_core_thread(core, peer):
    peer.send(m.FlushCache(0, 1))
    assert peer.reply(1).result == 3 and core.engine.flushed_on == ["forkjax-core"]
    peer.send(m.GetStats(0, 2))
    stats = peer.reply(2).result
    assert stats["base_pages_total"] == 64 and stats["adapters"] == 2


def test_shutdown_stops_the_loop(core, peer):
    assert submit(peer, 1, "a", FOREVER).error is None
    peer.send(m.Shutdown(0))
    assert peer.until_finished(1)[-1].finish_reason == "shutdown"
    core.thread.join(5)
    assert not core.thread.is_alive()


# ---- the HTTP app over the core ---------------------------------------------------------------

@pytest.fixture
def http(core):
    from fastapi.testclient import TestClient

    from forkjax.server.app import create_app
    client = front_end(core)
    app = create_app(client, model_name="base", model_root="base", api_key="k")
    try:
        with TestClient(app, headers={"Authorization": "Bearer k"}) as c:
            c.core_client = client
            yield c
    finally:
        client.process.kill()
        client.process.wait()
        client.context.destroy(linger=0)


def test_session_salt_and_fanout_reach_every_choice(http, core):
    r = http.post("/v1/completions", json={"model": "a", "prompt": [[1, 2], [3]], "n": 2, "max_tokens": 2,
                                           "session_id": "wf-1", "fanout_adapters": ["b"],
                                           "cache_salt": "team-a", "session_end": True,
                                           "session_tokens": 900})
    assert r.status_code == 200, r.text
    assert [(s.session_id, s.session_end, s.session_tokens, s.targets, s.adapter_key)
            for s in core.engine.added] == [("wf-1", True, 900, {"b": "b"}, salted("a", "team-a"))] * 4


def test_bad_fanout_is_refused_before_anything_is_queued(http, core):
    def completion(fanout):
        r = http.post("/v1/completions", json={"prompt": [1], "max_tokens": 2, "fanout_adapters": fanout})
        return r.status_code, r.json().get("error", {}).get("param"), r.json().get("error", {}).get("code")

    assert completion(["a", "zzz"]) == (404, "fanout_adapters", "model_not_found")
    assert completion(["base"]) == (404, "fanout_adapters", "model_not_found")  # the base has no residual
    http.core_client.adapters = {**http.core_client.adapters, "ghost": "x"}  # gone from the core
    assert completion(["ghost"]) == (404, "fanout_adapters", "model_not_found")
    assert core.engine.added == []
    assert completion([])[0] == 200  # [] is no fan-out, under any policy


def test_the_engines_refusal_names_the_field_at_fault(http, core, monkeypatch):
    def refuse(param):
        def add_request(*args, **kwargs):
            raise InvalidArgument(param, f"{param} is wrong")
        monkeypatch.setattr(core.engine, "add_request", add_request)

    refuse("fanout_adapters")
    r = http.post("/v1/completions", json={"prompt": [1], "max_tokens": 2, "fanout_adapters": ["a"]})
    assert r.status_code == 400 and r.json()["error"] | {"type": None} == {
        "message": "fanout_adapters is wrong", "type": None, "param": "fanout_adapters", "code": None}
    refuse("prompt")  # the engine's prompt is a chat request's messages
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_flush_cache_runs_in_the_core_behind_the_key(http, core):
    assert http.post("/flush_cache", headers={"Authorization": ""}).status_code == 401
    assert http.post("/flush_cache/", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert core.engine.flushed_on == []
    r = http.post("/flush_cache")
    assert r.status_code == 200 and r.text == "Cache flushed. 3 KV pages freed."
    assert core.engine.flushed_on == ["forkjax-core"]


def test_when_the_core_dies_streams_end_with_an_error_and_requests_get_503(http, core):
    lines = []

    def stream():
        with http.stream("POST", "/v1/completions", json={"prompt": [1], "max_tokens": 1000,
                                                          "stream": True}) as r:
            lines.extend(r.iter_lines())
    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + 10
    while not core.engine.running:
        assert time.monotonic() < deadline, lines
        time.sleep(0.01)
    http.core_client.process.kill()  # the stand-in for the core's process
    reader.join(10)
    data = [line for line in lines if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]" and '"code": "engine_unavailable"' in data[-2], data[-3:]
    assert http.get("/health").status_code == 503
    r = http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
    assert r.status_code == 503 and "engine core process died" in r.json()["error"]["message"]
