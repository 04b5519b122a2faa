"""Concurrent clients, cancellation on disconnect and the Prometheus metrics of a running
server (serve_utils.py)."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys

import httpx
import pytest

from serve_utils import AUTH, BASE, DEMO, KEY, complete, wait_for


SYSTEM = ("You are one of four agents sharing this workspace. Read the whole task, think step by "
          "step, and answer in one short line. ") * 2


def _agent_request(i: int) -> tuple[str, dict]:
    model = (BASE, *DEMO)[i % 4]
    common = dict(model=model, max_tokens=8, temperature=0, ignore_eos=True, return_token_ids=True)
    if i % 2:
        return "/v1/chat/completions", {**common, "messages": [
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Agent {i}: step {i * 7}?"}]}
    return "/v1/completions", {**common, "prompt": f"{SYSTEM}\nAgent {i}: step {i * 7}?"}


def _answer(body: dict) -> tuple[str, list[int]]:
    c = body["choices"][0]
    return c.get("text", c.get("message", {}).get("content")), c["token_ids"]


def test_64_concurrent_clients_equal_one_by_one(server):
    requests = [_agent_request(i) for i in range(64)]

    async def run_all():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=300,
                                     limits=httpx.Limits(max_connections=64)) as client:
            async def one(path, body):
                r = await client.post(path, json=body)
                assert r.status_code == 200, r.text
                return _answer(r.json())
            return await asyncio.gather(*(one(p, b) for p, b in requests))

    before = server.metrics()
    together = asyncio.run(run_all())
    during = server.metrics()
    with server.http() as http:
        alone = [_answer(http.post(p, json=b).json()) for p, b in requests]
    assert together == alone
    assert all(len(ids) == 8 for _, ids in together)
    assert during["forkjax:decode_batch_size_mean"] > before["forkjax:decode_batch_size_mean"] >= 0
    assert during["forkjax:decode_batch_size_mean"] > 1  # requests really were batched
    assert during['forkjax:prefix_cache_hit_tokens_total{pool="base"}'] > \
        before['forkjax:prefix_cache_hit_tokens_total{pool="base"}']  # the shared prompt was reused




def test_client_disconnect_cancels_and_frees(server):
    aborted = 'forkjax:request_success_total{finished_reason="abort"}'
    # Nearly the whole 960-token pool. An idle CI machine once decoded all 900 tokens within the
    # plain request's former 1 s timeout; 0.2 s leaves a wide margin.
    budget = 900
    long = {"prompt": "never mind", "max_tokens": budget, "ignore_eos": True}
    before = server.metrics()
    with server.http() as http, http.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
        next(r.iter_lines())  # streaming has begun; now hang up
    after = wait_for(server, lambda m: m[aborted] == before[aborted] + 1)
    # Plain (non-streaming) requests are watched too: a client that times out cancels.
    with pytest.raises(httpx.ReadTimeout), server.http(timeout=0.2) as http:
        http.post("/v1/completions", json=long)
    final = wait_for(server, lambda m: m[aborted] == before[aborted] + 2
                      and m["forkjax:num_requests_running"] == 0)
    assert final["forkjax:generation_tokens_total"] - before["forkjax:generation_tokens_total"] < 2 * budget
    assert after["forkjax:num_requests_waiting"] == 0


CLIENT = """
import sys, httpx
body = {"prompt": "a killed client", "max_tokens": 900, "ignore_eos": True, "stream": True}
with httpx.stream("POST", sys.argv[1] + "/v1/completions", json=body, timeout=120,
                  headers={"Authorization": "Bearer " + sys.argv[2]}) as r:
    for line in r.iter_lines():
        print(line, flush=True)
"""


def test_a_client_killed_mid_stream_is_aborted_and_its_pages_freed(server):
    used = 'forkjax:kv_pages_used{pool="base"}'
    with server.http() as http:
        http.post("/flush_cache")
    idle = server.metrics()[used]
    client = subprocess.Popen([sys.executable, "-c", CLIENT, server.url, KEY], stdout=subprocess.PIPE)
    try:
        assert client.stdout.readline().startswith(b"data: ")  # streaming has begun
        assert server.metrics()["forkjax:num_requests_running"] == 1
    finally:
        client.kill()
        client.wait()
    wait_for(server, lambda m: m["forkjax:num_requests_running"] == 0)
    with server.http() as http:
        http.post("/flush_cache")
    assert server.metrics()[used] == idle


def test_metrics_prometheus_format(server):
    prompt = "count me " * 6  # 55 tokens: three whole pages to hit the second time
    with server.http() as http:
        complete(http, model="coder", prompt=prompt, max_tokens=5, ignore_eos=True)
        before = server.metrics()
        complete(http, model="coder", prompt=prompt, max_tokens=5, ignore_eos=True)
        text = httpx.get(f"{server.url}/metrics").text
    after = server.metrics()
    assert httpx.get(f"{server.url}/metrics").headers["content-type"].startswith("text/plain; version=0.0.4")
    for line in text.splitlines():  # the exposition format, line by line
        assert re.fullmatch(r"# (HELP|TYPE) forkjax:\w+ .+|forkjax:\w+\{[^}]*\} -?[\d.e+-]+|", line), line
    assert after["forkjax:generation_tokens_total"] - before["forkjax:generation_tokens_total"] == 5
    assert after['forkjax:prefix_cache_hit_tokens_total{pool="base"}'] > \
        before['forkjax:prefix_cache_hit_tokens_total{pool="base"}']  # same prompt: a cache hit
    for key in ("forkjax:num_requests_running", "forkjax:num_requests_waiting",
                'forkjax:kv_pages_used{pool="base"}', 'forkjax:kv_pages_used{pool="residual"}',
                'forkjax:prefix_cache_hit_rate{pool="base"}', 'forkjax:prefix_cache_hit_rate{pool="residual"}',
                "forkjax:decode_batch_size_mean", 'forkjax:kv_pages_total{pool="base"}',
                "forkjax:host_bytes_used", 'forkjax:host_bytes_transferred_total{direction="stored"}',
                "forkjax:host_load_stall_seconds_total",  # the test server has a host tier
                "forkjax:lora_adapters_in_slots", "forkjax:lora_swaps_total", "forkjax:lora_swap_wait_seconds_total"):
        assert key in after, key
    assert 0 < after['forkjax:prefix_cache_hit_rate{pool="base"}'] <= 1
    assert after['forkjax:kv_pages_used{pool="base"}'] > 0
    for name, n in (("time_to_first_token", 1), ("inter_token_latency", 4), ("e2e_request_latency", 1),
                    ("request_queue_time", 1)):  # one request of 5 tokens
        key = f"forkjax:{name}_seconds"
        assert after[key + "_count"] - before[key + "_count"] == n, name
        cumulative = [v for k, v in after.items() if k.startswith(key + "_bucket")]
        assert cumulative == sorted(cumulative) and cumulative[-1] == after[key + "_count"]
        assert after[key + '_bucket{le="+Inf"}'] == after[key + "_count"] and after[key + "_sum"] >= 0
