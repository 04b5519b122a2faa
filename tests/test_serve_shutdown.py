"""Stopping the server while requests run: once --shutdown-timeout has passed, the engine core
aborts what is left and every client gets an OpenAI-shaped answer (a 503 error, or an error
event then `data: [DONE]` on a stream) instead of a cut connection, and the log says so in one
line, without a traceback. When the engine core's process is killed, the same answers come at
once and the server exits with status 1."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import openai
import pytest
from serve_utils import KEY, Server, start_server


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


def _core_pid(server_pid: int) -> int:
    """The engine core's process: the server's child running forkjax.server.core_proc."""
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, ValueError):
            continue
        if ppid == server_pid and b"forkjax.server.core_proc" in cmdline:
            return int(pid)
    raise AssertionError("no engine core process")


def test_a_killed_engine_core_fails_requests_and_the_server_exits_1(stoppable):
    server, proc = stoppable
    with server.http() as http:
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    running = lambda: server.metrics()["forkjax:num_requests_running"]  # noqa: E731
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        def plain():
            with server.http() as http:
                return http.post("/v1/completions", json={"prompt": "a long answer", **LONG})
        plain_done = pool.submit(plain)
        _wait(lambda: running() == 1, "the request to run")
        os.kill(_core_pid(proc.pid), signal.SIGKILL)
        killed_at = time.monotonic()
        response = plain_done.result(30)
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "engine_unavailable"
    with server.http() as http:  # new requests, until the server is gone
        late = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert late.status_code == 503 and "exit status -9" in late.json()["error"]["message"]
    assert proc.wait(timeout=30) == 1
    assert time.monotonic() - killed_at < 10
    assert "forkjax: stopped: the engine core process died (exit status -9)" in server.log.read_text()
