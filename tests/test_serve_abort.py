"""A client that leaves while its long prompt is being prefilled chunk by chunk: its request
ends within two chunks and its pages go back, streamed or not, and so does the scoring of a
prompt that is echoed with its logprobs (a server of its own, serve_utils.py, whose prefill of
one prompt takes sixty chunks)."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlparse

import pytest

from serve_utils import KEY, serve, wait_for

CHUNK = 64  # --max-prefill-tokens
PROMPT_TOKENS = 3840  # sixty chunks
ARGS = ["--dtype", "float32", "--cache-policy", "prefix", "--max-batch-size", "2",
        "--max-prefill-tokens", str(CHUNK), "--max-model-len", "4096", "--kv-cache-bytes", "32M",
        "--warmup", "none", "--api-key", KEY, "--host", "127.0.0.1", "--port", "0"]
COMPUTED = "forkjax:prefill_tokens_computed_total"
ABORTED = 'forkjax:request_success_total{finished_reason="abort"}'
USED = 'forkjax:kv_pages_used{pool="base"}'


@pytest.fixture(scope="module")
def long_server(tmp_path_factory):
    yield from serve(tmp_path_factory, ARGS)


def _post(url: str, path: str, body: dict) -> socket.socket:
    """Send a request on a connection of its own, whose closing is the client leaving."""
    where = urlparse(url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((where.hostname, where.port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {where.netloc}\r\nAuthorization: Bearer {KEY}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.mark.parametrize("path,extra", [
    ("/v1/completions", {"stream": True}), ("/v1/completions", {}),
    ("/v1/chat/completions", {"stream": True}),
    ("/v1/completions", {"echo": True, "logprobs": 1}),  # scored by the core before generating
])
def test_a_client_that_leaves_mid_prefill_is_aborted_within_two_chunks(long_server, path, extra):
    server = long_server
    with server.http() as http:  # nothing cached: every chunk is computed
        assert http.post("/flush_cache").status_code == 200
    start = server.metrics()
    prompt = [3 + (i * 7919) % 250 for i in range(PROMPT_TOKENS)]
    body = {"max_tokens": 4, "ignore_eos": True, **extra}
    if path == "/v1/completions":
        body["prompt"] = prompt
    else:  # as text: about one token per character
        body["messages"] = [{"role": "user", "content": "".join(chr(97 + t % 26) for t in prompt)}]
    sock = _post(server.url, path, body)
    try:
        # a few chunks in, the client leaves
        left = wait_for(server, lambda m: m[COMPUTED] - start[COMPUTED] >= 4 * CHUNK, timeout=300)
    finally:
        sock.close()
    left_at = time.monotonic()
    freed = wait_for(server, lambda m: m["forkjax:num_requests_running"] == 0, timeout=300)
    freed_s = time.monotonic() - left_at
    computed = freed[COMPUTED] - left[COMPUTED]  # counted as each chunk is scheduled
    assert computed <= 2 * CHUNK, (computed, freed_s)
    assert freed[COMPUTED] - start[COMPUTED] <= PROMPT_TOKENS // 4  # long before the prefill's end
    # a generation's abort is counted as its end reaches the front end; a scoring left before
    # any generation began has none
    aborted = start[ABORTED] + (0 if extra.get("echo") else 1)
    wait_for(server, lambda m: m[ABORTED] == aborted)
    assert freed["forkjax:num_requests_waiting"] == 0
    with server.http() as http:  # what it computed was cached; nothing else is held
        assert http.post("/flush_cache").status_code == 200
    assert server.metrics()[USED] == 0
