"""Helpers of the server tests: a real `python -m forkjax.serve` process on a free loopback port,
driven over HTTP with httpx and the official `openai` client.

The `server` and `forkkv_server` fixtures (conftest.py) start one of each per xdist worker that
runs any server test, so every test sees only its own worker's traffic and may read the
server's counters. `server` runs the exact `prefix` policy in float32 (concurrent answers must
equal one-by-one answers), small compile buckets, a 1024-token context and a KV pool smaller than
that context (to reach the "does not fit the pool" error). Residual fan-out needs `forkkv`: one
test uses a second, smaller server for it. The agent frameworks' tests use a third,
`agents_server`, whose context holds their longer prompts (AGENTS_ARGS).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import openai
from safetensors.numpy import save_file

REPO = Path(__file__).resolve().parents[1]
KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BASE = "tiny-llama"
DEMO = ("planner", "coder", "critic")
CONTEXT = 1024
SERVER_ARGS = ["--dtype", "float32", "--cache-policy", "prefix", "--max-batch-size", "8",
               "--max-prefill-tokens", "128", "--max-model-len", str(CONTEXT), "--kv-cache-bytes", "2M",
               "--host-kv-bytes", "8M",
               "--api-key", KEY, "--max-request-bytes", "1M", "--body-timeout", "5", "--host", "127.0.0.1",
               "--port", "0"]
STARTUP_S = 420  # a cold compile cache on 2 busy cores


class Server:
    def __init__(self, url: str, log: Path):
        self.url, self.log = url, log

    def http(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=AUTH, timeout=kw.pop("timeout", 120), **kw)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        """{'name{labels}': value} with the model_name label dropped."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                name = re.sub(r'model_name="[^"]*",?', "", name).replace(",}", "}").replace("{}", "")
                out[name] = float(value)
        return out


# Fan-out on, forkkv's default: every request writes every adapter's residual unless it names its
# group. One request at a time and 32-token prefill chunks: three programs to compile.
FORKKV_ARGS = ["--dtype", "float32", "--cache-policy", "forkkv", "--residual-fraction", "0.5",
               "--max-batch-size", "1", "--max-prefill-tokens", "32", "--max-model-len", "128",
               "--kv-cache-bytes", "1M", "--host", "127.0.0.1", "--port", "0"]

# The agent frameworks' server (test_agents_*.py). Their prompts carry tool schemas and
# instructions in the chat template's Hermes system message: 1-2 KB, which tiny-llama's byte
# tokenizer makes 1-2k tokens, past `server`'s 1024-token context. A 4096-token context, a pool
# for a few such prompts, and no warm-up: the tests compile only the step programs they use. The
# exact `prefix` policy: an adapter's answer does not depend on which adapter computed the K/V of
# its prompt's prefix first, so whether random weights call a tool again or answer does not
# depend on the order the tests ran in.
AGENTS_ARGS = ["--dtype", "float32", "--cache-policy", "prefix", "--max-model-len", "4096",
               "--kv-cache-bytes", "16M", "--max-prefill-tokens", "512", "--max-batch-size", "4",
               "--warmup", "none", "--api-key", KEY, "--host", "127.0.0.1", "--port", "0"]


def serve(tmp_path_factory, args: list[str]):
    """Start `python -m forkjax.serve` with `args`; yield a Server once it is ready; stop it
    with SIGTERM and check that it drained and exited 0."""
    log = tmp_path_factory.mktemp("serve") / "server.log"
    proc, url = start_server(args, log)
    try:
        yield Server(url, log)
        assert proc.poll() is None, f"the server died:\n{log.read_text()[-4000:]}"
        proc.terminate()  # SIGTERM: a drained stop, exit status 0
        assert proc.wait(timeout=60) == 0, log.read_text()[-4000:]
        assert "forkjax: SIGTERM: stopping" in log.read_text() and "forkjax: stopped" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def start_server(args, log: Path) -> tuple[subprocess.Popen, str]:
    """`python -m forkjax.serve *args` logging to `log` -> (its process, its URL once ready); the
    process is killed if it never gets there."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(REPO / ".cache" / "jax"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "forkjax.serve", *args], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + STARTUP_S
        while (m := re.search(r"forkjax: ready: .* at (http://\S+)/v1", log.read_text())) is None:
            assert proc.poll() is None, f"server exited {proc.returncode}:\n{log.read_text()[-4000:]}"
            assert time.time() < deadline, f"server not ready in {STARTUP_S}s:\n{log.read_text()[-4000:]}"
            time.sleep(0.2)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, m[1]


def complete(http: httpx.Client, **body) -> dict:
    r = http.post("/v1/completions", json={"temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def sse_events(lines) -> list:
    """Parse `data:` events of a server-sent event stream, checking it ends with [DONE]."""
    data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


def write_peft(path: Path, *, r=8, alpha=16, targets=("q_proj", "v_proj"), hidden=128, kv=64,
               layers=4, seed=0, **config) -> Path:
    """A PEFT LoRA directory for tiny-llama's shapes (other `hidden` -> another base model);
    `config`: more adapter_config.json fields."""
    shapes = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (hidden, hidden)}
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(layers):
        for m in targets:
            d_in, d_out = shapes[m]
            key = f"base_model.model.model.layers.{i}.self_attn.{m}"
            a = rng.standard_normal((r, d_in)) * d_in ** -0.5
            tensors[f"{key}.lora_A.weight"] = a.astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.standard_normal((d_out, r)).astype(np.float32)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets), **config}))
    return path



def wait_for(server, pred, timeout=20.0) -> dict:
    deadline = time.time() + timeout
    while not pred(m := server.metrics()):
        assert time.time() < deadline, m
        time.sleep(0.05)
    return m


