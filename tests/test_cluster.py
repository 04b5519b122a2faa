"""`python -m forkjax.cluster --replicas 2`: two real `forkjax.serve` workers behind a real SMG
gateway, on loopback. Adapters reach the worker by name (`lora_path`, which SMG forwards as
sent), one routing key stays on one worker (each worker's own /metrics counts its requests), and
a worker killed mid-run fails only its own requests: the other's workflows finish, its keys move
to the survivor within seconds, and the same worker restarted on its port takes them back."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import bench_workflows
from forkjax.cluster.launcher import free_port, worker_command
from serve_utils import BASE, DEMO, REPO, Server, sse_events, wait_for

SERVE_ARGS = ["--model", BASE, "--dtype", "float32", "--kv-cache-bytes", "8M", "--max-model-len", "1024",
              "--max-batch-size", "4", "--max-prefill-tokens", "64", "--warmup", "none"]
KEYS = [f"workflow-{i}" for i in range(32)]  # tried until both workers own some (after 4 at least)
STARTUP_S = 420  # a cold compile cache on 2 busy cores


def _env() -> dict:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(REPO / ".cache" / "jax"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


class Running:
    """The cluster's process, its printed worker URLs and gateway URL."""

    def __init__(self, proc: subprocess.Popen, log: Path):
        self.proc, self.log = proc, log
        self.workers: list[str] = []
        self.gateway = ""
        for line in proc.stdout:
            kind, url = line.split()
            assert kind in ("worker", "gateway"), line
            if kind == "worker":
                self.workers.append(url)
            else:
                self.gateway = url
                break
        assert self.gateway and len(self.workers) == 2, log.read_text()[-4000:]

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.gateway, timeout=120)


@pytest.fixture
def cluster(tmp_path):
    log = tmp_path / "cluster.log"
    cmd = [sys.executable, "-m", "forkjax.cluster", "--replicas", "2", "--port", str(free_port()), *SERVE_ARGS]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=err, text=True)
    timer = threading.Timer(STARTUP_S, proc.kill)  # a start that never ends fails, not hangs
    timer.start()
    try:
        running = Running(proc, log)
        timer.cancel()
        yield running
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, log.read_text()[-4000:]
        assert not _children(proc.pid), "SIGTERM left processes running"
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def finished(url: str) -> int:
    """Requests the worker at `url` finished, from its own /metrics."""
    return int(sum(v for k, v in Server(url, Path()).metrics().items()
                   if k.startswith("forkjax:request_success_total")))


def completion(http: httpx.Client, key: str, adapter: str | None, **body) -> httpx.Response:
    fields = {"model": BASE, "prompt": f"{key} asks", "max_tokens": 4, "temperature": 0, **body}
    if adapter is not None:
        fields["lora_path"] = adapter
    return http.post("/v1/completions", json=fields, headers={"X-SMG-Routing-Key": key})


def test_cluster(cluster, tmp_path):
    """One cluster for the four checks (as separate tests, xdist could start one per worker)."""
    adapters_route_by_name(cluster)
    owner = one_key_one_worker(cluster)
    bench_through_the_gateway(cluster, tmp_path, bench_workflows())
    killed_worker(cluster, owner)


def adapters_route_by_name(cluster):
    """Each adapter answers through the gateway as the worker itself answers for that adapter by
    `model`; the response names it. SMG registers a worker under one model id, so `model` with
    an adapter's name alone finds no worker there."""
    texts = set()
    with cluster.http() as http, httpx.Client(base_url=cluster.workers[0], timeout=120) as direct:
        for adapter in (None, *DEMO):
            r = completion(http, "names", adapter)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == (adapter or BASE)
            want = direct.post("/v1/completions", json={"model": adapter or BASE, "prompt": "names asks",
                                                         "max_tokens": 4, "temperature": 0}).json()
            assert r.json()["choices"][0]["text"] == want["choices"][0]["text"]
            texts.add(want["choices"][0]["text"])
        ids = [72, 105, 33]  # the driver's form for token ids: SMG's `prompt` is text only
        r = completion(http, "names", "critic", prompt="", prompt_token_ids=ids)
        want = direct.post("/v1/completions", json={"model": "critic", "prompt": ids, "max_tokens": 4,
                                                     "temperature": 0}).json()
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want["choices"][0]["text"], r.text
        r = http.post("/v1/chat/completions", headers={"X-SMG-Routing-Key": "names"},
                      json={"model": BASE, "lora_path": "coder", "max_tokens": 2,
                            "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["model"] == "coder", r.text
        r = http.post("/v1/completions", json={"model": "planner", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 404 and "planner" in r.text, r.text
    assert len(texts) == 1 + len(DEMO), "the adapters must answer differently for the check to mean anything"


def one_key_one_worker(cluster) -> dict[str, int]:
    """Every request of a key (all agents, several turns) lands on one worker, and the keys
    spread over both."""
    owner = {}
    with cluster.http() as http:
        for key in KEYS:
            before = [finished(u) for u in cluster.workers]
            for turn in range(2):
                for adapter in DEMO:
                    r = completion(http, key, adapter, session_id=key, session_end=turn == 1 and adapter == DEMO[-1])
                    assert r.status_code == 200, r.text
            grew = [finished(u) - b for u, b in zip(cluster.workers, before)]
            assert sorted(grew) == [0, 2 * len(DEMO)], (key, grew)
            owner[key] = grew.index(2 * len(DEMO))
            if len(owner) >= 4 and set(owner.values()) == {0, 1}:
                break
    assert set(owner.values()) == {0, 1}, owner
    return owner


def bench_through_the_gateway(cluster, tmp_path, bench):
    """`bench_workflows.py --router`: each workflow's calls carry its key, so the prefill the two
    workers computed is the minimal prefill of one engine that saw every workflow (minimal.py,
    from the calls alone); scattered agents would recompute each other's prefixes."""
    (row,) = bench.main(["--router", cluster.gateway, "--model", BASE, "--pattern", "react", "--workflows", "4",
                         "--context", "64", "--gen", "4", "--obs", "4", "--rounds", "2", "--dtype", "float32",
                         "--policy", "forkkv", "--max-batch-size", "4", "--out", str(tmp_path / "bench")])
    assert row["replicas"] == 2 and row["base_hit_rate"] > 0.5, row
    assert row["prefill_tokens_computed"] == row["prefill_tokens_minimal"], row


def killed_worker(cluster, owner: dict[str, int]):
    """SIGKILL one worker while both run requests: its streamed request ends with an error, its
    other request is retried on the survivor, the survivor's workflows all finish, nothing hangs,
    the victim's keys are served again within 30 s, and the worker restarted by hand on its port
    takes its keys back."""
    victim_keys = [k for k, w in owner.items() if w == 0]
    victim_key = victim_keys[0]
    survivor_keys = [k for k, w in owner.items() if w == 1]
    victim_url, pid = cluster.workers[0], _pid_listening(cluster.proc.pid, cluster.workers[0])
    results: dict[str, object] = {}

    def survivor_workflow(key):
        with cluster.http() as http:
            codes = [completion(http, key, a, max_tokens=32, session_id=key).status_code
                     for _ in range(3) for a in DEMO]
        results[key] = codes

    def victim_stream():
        with cluster.http() as http, http.stream(
                "POST", "/v1/completions", headers={"X-SMG-Routing-Key": victim_key},
                json={"model": BASE, "lora_path": "planner", "prompt": "long", "max_tokens": 900,
                      "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}) as stream:
            try:
                results["victim stream"] = [stream.status_code, *stream.iter_lines()]
            except httpx.HTTPError as e:  # the gateway cut the stream
                results["victim stream"] = [stream.status_code, f"cut: {e!r}"]

    def victim_request():
        with cluster.http() as http:
            r = completion(http, victim_key, "coder", max_tokens=900, ignore_eos=True)
            results["victim request"] = [r.status_code, r.json()]

    threads = [threading.Thread(target=f) for f in (victim_stream, victim_request)]
    threads += [threading.Thread(target=survivor_workflow, args=(k,)) for k in survivor_keys]
    for t in threads:
        t.start()
    victim = Server(victim_url, Path())
    wait_for(victim, lambda m: m.get("forkjax:num_requests_running", 0) >= 2
             and m.get("forkjax:generation_tokens_total", 0) > 0, timeout=60)
    os.kill(pid, signal.SIGKILL)  # mid-run: both of its requests are in the running batch
    killed = time.time()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a request hung"
    # The streamed request had sent tokens: the gateway ends it with an error event. The other
    # had not answered yet: the gateway retried it on the next worker of the ring, whole.
    code, *lines = results["victim stream"]
    *tokens, error = sse_events(lines)
    assert code == 200 and "Stream error" in error["error"]["message"], lines[-3:]
    assert 0 < sum(len(e["choices"][0]["token_ids"]) for e in tokens) < 900
    code, body = results["victim request"]
    assert code == 200 and body["usage"]["completion_tokens"] == 900, body
    assert time.time() - killed < 30
    assert all(results[k] == [200] * 3 * len(DEMO) for k in survivor_keys), results

    with cluster.http() as http:  # the victim's keys move to the survivor
        for key in victim_keys:
            while (r := completion(http, key, "critic")).status_code != 200:
                assert time.time() - killed < 30, r.text
                time.sleep(0.5)
        port = int(victim_url.rsplit(":", 1)[1])
        restarted = subprocess.Popen(worker_command(SERVE_ARGS, port), cwd=REPO, env=_env(),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.time() + STARTUP_S
            while True:  # healthy again: the gateway sends the key back to its owner
                try:
                    before = finished(victim_url)
                    if completion(http, victim_key, "critic").status_code == 200 and finished(victim_url) > before:
                        break
                except httpx.HTTPError:
                    pass
                assert time.time() < deadline and restarted.poll() is None
                time.sleep(0.5)
        finally:
            restarted.terminate()
            restarted.wait(timeout=90)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _pid_listening(parent: int, url: str) -> int:
    """The child of `parent` that listens on `url`'s port (its socket's inode in /proc/net/tcp)."""
    port = int(url.rsplit(":", 1)[1])
    inodes = {line.split()[9] for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
              if int(line.split()[1].split(":")[1], 16) == port and line.split()[3] == "0A"}
    for pid in _children(parent):
        fds = Path(f"/proc/{pid}/fd")
        if any(re.fullmatch(r"socket:\[(\d+)\]", os.readlink(fd)) and os.readlink(fd)[8:-1] in inodes
               for fd in fds.iterdir() if fd.is_symlink()):
            return pid
    raise AssertionError(f"no child of {parent} listens on {port}")
