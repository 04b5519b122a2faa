"""N `python -m forkjax.serve` replicas behind one Shepherd Model Gateway (SMG, `smg launch`).

Each worker runs with the same flags on a free loopback port (`--port 0`: the worker picks it
and prints it when ready). The gateway registers every worker by URL and learns the base
model's name from its `/v1/models`: SMG keeps one model per worker, so a request reaches an
adapter as `"model": BASE, "lora_path": ADAPTER` (SGLang's field, which SMG forwards as sent and
the server reads as the adapter). `consistent_hashing` sends every request that carries one
`X-SMG-Routing-Key` to one worker, walking the ring past a worker its health checks found dead;
a worker restarted on its port turns healthy again and takes its keys back.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

READY = re.compile(r"forkjax: ready: .* at (http://\S+)/v1")
HEALTH_PROBE = re.compile(r'"GET /health HTTP/[\d.]+" 200')
LOOPBACK = "127.0.0.1"
# A dead worker leaves the ring after HEALTH_FAILURES failed checks HEALTH_INTERVAL_S apart,
# and a restarted one rejoins after one good check: seconds, not SMG's default minutes.
HEALTH_INTERVAL_S, HEALTH_FAILURES, HEALTH_TIMEOUT_S = 1, 2, 2
DRAIN_S = 30  # the gateway's in-flight requests get as long as the workers' (--shutdown-timeout)
STOP_TIMEOUT_S = 60.0  # past both drains: killed


def smg_binary() -> str:
    """The `smg` of this Python's environment (the `cluster` extra), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "smg")
    found = here if os.access(here, os.X_OK) else shutil.which("smg")
    if found is None:
        raise RuntimeError("smg not found: pip install 'forkjax[cluster]' (or smg) into this environment")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def worker_command(serve_args: list[str], port: int = 0) -> list[str]:
    """The command of one worker: the same one restarts a dead worker on its old `port`."""
    return [sys.executable, "-m", "forkjax.serve", *serve_args, "--host", LOOPBACK, "--port", str(port)]


def gateway_command(host: str, port: int, workers: list[str], policy: str, metrics_port: int,
                    api_key: str | None) -> list[str]:
    cmd = [smg_binary(), "launch", "--host", host, "--port", str(port), "--worker-urls", *workers,
           "--policy", policy, "--prometheus-host", LOOPBACK, "--prometheus-port", str(metrics_port),
           "--health-check-interval-secs", str(HEALTH_INTERVAL_S),
           "--health-failure-threshold", str(HEALTH_FAILURES), "--health-success-threshold", "1",
           "--health-check-timeout-secs", str(HEALTH_TIMEOUT_S), "--log-level", "warn",
           "--shutdown-grace-period-secs", str(DRAIN_S)]
    return cmd + (["--api-key", api_key] if api_key else [])


class Cluster:
    """Start with `start()` (returns once the gateway routes to every worker), stop with `stop()`:
    SIGTERM to the gateway and every worker (each drains), SIGKILL past STOP_TIMEOUT_S. Worker and
    gateway output goes to `log` (default: our stderr), each line tagged with its process."""

    def __init__(self, replicas: int, port: int, serve_args: list[str], *, host: str = LOOPBACK,
                 policy: str = "consistent_hashing", start_timeout_s: float = 1800.0, log=None):
        if replicas < 1:
            raise ValueError(f"--replicas={replicas}: expected >= 1")
        self.replicas, self.port, self.host, self.policy = replicas, port, host, policy
        self.serve_args, self.start_timeout_s = serve_args, start_timeout_s
        self.api_key = _flag(serve_args, "--api-key")
        self.log = log or sys.stderr
        self.workers: list[subprocess.Popen] = []
        self.worker_urls: list[str | None] = []
        self.gateway: subprocess.Popen | None = None
        self.gateway_url = f"http://{host}:{port}"
        self.metrics_url = ""
        self._lock = threading.Lock()

    def start(self, on_worker=None) -> Cluster:
        """Start the workers, then the gateway; `on_worker(url)` is called as each is ready."""
        try:
            deadline = time.time() + self.start_timeout_s
            self.workers = [self._spawn(worker_command(self.serve_args), f"worker {i}")
                            for i in range(self.replicas)]
            self.worker_urls = [None] * self.replicas
            for i, proc in enumerate(self.workers):
                self.worker_urls[i] = self._wait_ready(i, proc, deadline)
                if on_worker:
                    on_worker(self.worker_urls[i])
            metrics_port = free_port()
            self.metrics_url = f"http://{LOOPBACK}:{metrics_port}/metrics"
            self.gateway = self._spawn(gateway_command(self.host, self.port, self.worker_urls, self.policy,
                                                       metrics_port, self.api_key), "gateway")
            self._wait_routable(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self):
        procs = [p for p in [self.gateway, *self.workers] if p is not None]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.time() + STOP_TIMEOUT_S
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # ---- internals -------------------------------------------------------------------------

    def _spawn(self, cmd: list[str], tag: str) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1, start_new_session=True)  # Ctrl-C reaches us alone: we stop them
        proc.ready_url = None
        threading.Thread(target=self._forward, args=(proc, tag), daemon=True).start()
        return proc

    def _forward(self, proc: subprocess.Popen, tag: str):
        for line in proc.stdout:
            if proc.ready_url is None and (m := READY.search(line)):
                proc.ready_url = m[1]
            if HEALTH_PROBE.search(line):  # the gateway's, every second
                continue
            with self._lock:
                self.log.write(f"[{tag}] {line}")
                self.log.flush()

    def _wait_ready(self, i: int, proc: subprocess.Popen, deadline: float) -> str:
        while proc.ready_url is None:
            if proc.poll() is not None:
                raise RuntimeError(f"worker {i} exited with status {proc.returncode} before it was ready")
            if time.time() > deadline:
                raise RuntimeError(f"worker {i} not ready in {self.start_timeout_s:.0f} s")
            time.sleep(0.1)
        return proc.ready_url

    def _wait_routable(self, deadline: float):
        """Until the gateway lists every worker as healthy (it has read their model by then)."""
        while True:
            if self.gateway.poll() is not None:
                raise RuntimeError(f"the gateway exited with status {self.gateway.returncode}")
            try:
                auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
                listed = httpx.get(f"{self.gateway_url}/workers", headers=auth, timeout=5).json()["workers"]
                healthy = {w["url"] for w in listed if w.get("is_healthy") and w.get("model_id")}
                if healthy >= set(self.worker_urls):
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.time() > deadline:
                raise RuntimeError(f"the gateway did not route to every worker in {self.start_timeout_s:.0f} s")
            time.sleep(0.2)


def _flag(args: list[str], name: str) -> str | None:
    """The value of `name` in argparse-style `args` (`--name V` or `--name=V`), else None."""
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a[len(name) + 1:]
    return None
