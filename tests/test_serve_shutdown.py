"""Stopping the server while requests run: once --shutdown-timeout has passed, the engine loop
aborts what is left and every client gets an OpenAI-shaped answer (a 503 error, or an error
event then `data: [DONE]` on a stream) instead of a cut connection, and the log says so in one
line, without a traceback."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time

import openai
import pytest
from serve_utils import KEY, Server, start_server
from test_serve_engine_loop import ScriptedEngine, submit

from forkjax.server.engine_loop import EngineLoop, ShuttingDown

FOREVER = 10**6  # tokens: the scripted engine's requests run until aborted


# ---- the engine loop over a scripted engine ---------------------------------------------------

def test_stop_requests_ends_running_queued_and_held_requests():
    loop = EngineLoop(ScriptedEngine())
    loop.start()
    try:
        running, added, _ = submit(loop, "a", FOREVER)
        added.result(5)
        unloaded = loop.after_drain("a", lambda: "unloaded")
        held_sink, held, _ = submit(loop, "a", 5)  # waits for the unload of "a"
        loop.stop_requests()
        assert running.done.wait(5)
        assert running.outputs[-1].finish_reason == "shutdown" and running.outputs[-1].error is None
        with pytest.raises(ShuttingDown):
            held.result(5)
        assert unloaded.result(5) == "unloaded" and not held_sink.outputs
        _, late, _ = submit(loop, "b", 5)
        with pytest.raises(ShuttingDown):
            late.result(5)
        assert loop.finished["shutdown"] == 1
    finally:
        loop.shutdown()
    assert not loop.alive


def test_shutdown_ends_the_requests_it_holds():
    loop = EngineLoop(ScriptedEngine())
    loop.start()
    sink, added, _ = submit(loop, "a", FOREVER)
    added.result(5)
    loop.shutdown()
    assert not loop.alive
    assert sink.done.is_set() and sink.outputs[-1].finish_reason == "shutdown"


# ---- a real server, stopped with SIGTERM ----------------------------------------------------

# Long requests (3000 tokens: seconds each on a CPU) outlast a 1 s drain; two run at once, a
# third waits in the queue.
SHUTDOWN_ARGS = ["--dtype", "float32", "--cache-policy", "prefix", "--max-batch-size", "2",
                 "--max-prefill-tokens", "128", "--max-model-len", "4096", "--kv-cache-bytes", "32M",
                 "--warmup", "none", "--api-key", KEY, "--host", "127.0.0.1", "--port", "0",
                 "--shutdown-timeout", "1"]
LONG = {"max_tokens": 3000, "ignore_eos": True}


@pytest.fixture
def stoppable(tmp_path):
    """(Server, process) of a `python -m forkjax.serve` that the test stops itself."""
    log = tmp_path / "server.log"
    proc, url = start_server(SHUTDOWN_ARGS, log)
    try:
        yield Server(url, log), proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait(pred, what: str, timeout: float = 120):
    deadline = time.time() + timeout
    while not pred():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_requests_cut_by_shutdown_get_an_error_and_the_log_no_traceback(stoppable):
    server, proc = stoppable
    with server.http() as http:  # compile the step programs first: the requests below then run
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    running = lambda: server.metrics()["forkjax:num_requests_running"]  # noqa: E731
    stream_lines: list[str] = []

    def plain():
        with server.http() as http:
            return http.post("/v1/completions", json={"prompt": "a long answer", **LONG})

    def raw_stream():
        body = {"messages": [{"role": "user", "content": "a long story"}], "stream": True, **LONG}
        with server.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                stream_lines.append(line)

    def client_stream():  # queued behind the two running requests until the shutdown
        stream = server.openai().completions.create(model="tiny-llama", prompt="queued", stream=True,
                                                    max_tokens=LONG["max_tokens"],
                                                    extra_body={"ignore_eos": True})
        with pytest.raises(openai.APIError, match="server is shutting down"):
            for _ in stream:
                pass

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        plain_done = pool.submit(plain)
        _wait(lambda: running() == 1, "the plain request to run")
        stream_done = pool.submit(raw_stream)
        _wait(lambda: any('"content":"' in line and '"content":""' not in line for line in stream_lines),
              "the stream's first tokens")
        queued_done = pool.submit(client_stream)
        _wait(lambda: server.metrics()["forkjax:num_requests_waiting"] == 1, "the third request to queue")
        proc.send_signal(signal.SIGTERM)
        stopped_at = time.monotonic()
        plain_response = plain_done.result(60)
        stream_done.result(60)
        queued_done.result(60)
    answered_s = time.monotonic() - stopped_at

    assert plain_response.status_code == 503, plain_response.text
    assert plain_response.headers["content-type"] == "application/json"
    error = plain_response.json()["error"]
    assert "server is shutting down" in error["message"]
    assert error["type"] == "server_error" and error["code"] == "server_shutting_down"
    assert set(error) == {"message", "type", "param", "code"}

    data = [line[len("data: "):] for line in stream_lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]", data[-3:]
    assert json.loads(data[-2]) == {"error": error}  # the same error, as the stream's last event
    assert all("error" not in json.loads(d) for d in data[:-2])
    # The drain's second, then the aborts (uvicorn would have cancelled them 5 s later, and they
    # would have had no error body: the shapes above show it did not come to that).
    assert answered_s >= 1, answered_s

    assert proc.wait(timeout=60) == 0
    log = server.log.read_text()
    assert log.count("forkjax: shutdown: aborting 3 request(s) still running after 1 s") == 1, log
    for bad in ("Traceback", "CancelledError", "ERROR"):
        assert bad not in log, log
    assert "forkjax: stopped" in log
