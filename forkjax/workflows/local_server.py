"""A real `python -m forkjax.serve` in a process of its own, as a user runs it, for the HTTP
benchmarks and the examples to drive.

The server and its engine own the device: the benchmark's process sends requests and reads
/metrics and must not start a JAX backend itself (on a GPU that takes 75% of its memory).
`probe_device` asks a short-lived child process instead what the server will run on, before the
server starts. The adapters the benchmark built in memory reach the server as PEFT directories
(`lora_flags`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import httpx

from forkjax.lora.peft import save_peft_adapter

_READY = re.compile(r"forkjax: ready: .* at (http://\S+)/v1")
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Past this the server's own drain (--shutdown-timeout, 30 s) has had its chance: kill it.
STOP_TIMEOUT_S = 60.0
LOG_TAIL_CHARS = 4000


def add_server_args(p: argparse.ArgumentParser, model: str = "smollm2-135m"):
    """An example's way to its server: --base-url (a running one), else one it starts for --model;
    --api-key."""
    p.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL"),
                   help="a running server's /v1 URL (default: start one for --model)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "EMPTY"))
    p.add_argument("--model", default=model, help="the base model of a server this starts")


@contextlib.contextmanager
def server_url(base_url: str | None, model: str, server_args: list[str]):
    """`base_url` (an example's --base-url), or the /v1 URL of a server started for `model` with
    `server_args`, stopped on leaving."""
    if base_url is not None:
        yield base_url
        return
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "server.log")
        print(f"=== starting python -m forkjax.serve --model {model} (log: {log})", flush=True)
        with ServerProcess(model, server_args, log_path=log) as server:
            yield server.url + "/v1"


def _env(env: dict | None) -> dict:
    """`env` (default: ours) with this checkout first on PYTHONPATH, so `-m forkjax...` finds it."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, env.get("PYTHONPATH")]))
    return env


class ServerProcess:
    """`python -m forkjax.serve --model MODEL --host 127.0.0.1 --port 0 *args` as a context manager:
    entering starts it (stdout and stderr to `log_path`) and returns once it prints its ready line
    (RuntimeError with the log's tail if it exits or `start_timeout_s` passes first); `url` is
    then http://127.0.0.1:PORT and `start_s` the seconds from launch to ready. Leaving sends
    SIGTERM and waits for the drained stop (kills it after STOP_TIMEOUT_S)."""

    def __init__(self, model: str, args: list[str], *, log_path: str, env: dict | None = None,
                 start_timeout_s: float = 1800.0):
        self.cmd = [sys.executable, "-m", "forkjax.serve", "--model", model, "--host", "127.0.0.1",
                    "--port", "0", *args]
        self.log_path, self.env, self.start_timeout_s = log_path, _env(env), start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.url, self.start_s = "", 0.0

    def __enter__(self) -> ServerProcess:
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        t = time.perf_counter()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        try:
            while (m := _READY.search(self.log())) is None:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the server exited ({self.proc.returncode}) before it was ready:"
                                       f"\n{self.log()[-LOG_TAIL_CHARS:]}")
                if time.perf_counter() - t > self.start_timeout_s:
                    raise RuntimeError(f"the server was not ready in {self.start_timeout_s:g} s:"
                                       f"\n{self.log()[-LOG_TAIL_CHARS:]}")
                time.sleep(0.1)
        except BaseException:
            self._stop()
            raise
        self.url, self.start_s = m[1], time.perf_counter() - t
        return self

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds (user + system) so far of the front end (the server's process) and of the
        engine core (its child)."""
        return {"front_end": _cpu_s(self.proc.pid),
                "engine_core": sum(map(_cpu_s, _children(self.proc.pid)))}

    def flush(self) -> None:
        """POST /flush_cache: every KV page no running request holds is freed."""
        httpx.post(f"{self.url}/flush_cache", timeout=600).raise_for_status()

    def __exit__(self, *exc):
        self._stop()

    def _stop(self):
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()  # SIGTERM: running requests drain, then it exits
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


_PROBE = ("import json, jax; from forkjax.engine import memory; gpu = jax.default_backend() == 'gpu'; "
          "print(json.dumps(dict(backend=jax.default_backend(), device_kind=jax.devices()[0].device_kind, "
          "max_batch_size=memory.default_max_batch_size(gpu, memory.device_memory()[0]))))")


def probe_device(env: dict | None = None) -> dict:
    """{backend, device_kind, max_batch_size (the engine's default there)} of the device a server
    started with `env` gets, from a child process that exits before the server starts."""
    run = subprocess.run([sys.executable, "-c", _PROBE], env=_env(env), capture_output=True, text=True,
                         timeout=600)
    if run.returncode:
        raise RuntimeError(f"probing the device failed:\n{run.stderr[-LOG_TAIL_CHARS:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def lora_flags(adapters: dict, root: str) -> list[str]:
    """Save each LoraAdapter of {name: adapter} as the PEFT directory root/name -> the server's
    `--lora name=dir` flags."""
    flags = []
    for name, adapter in adapters.items():
        flags += ["--lora", f"{name}={save_peft_adapter(adapter, os.path.join(root, name))}"]
    return flags
