"""Start-up: seconds from launching `python -m forkjax.serve` to /health answering and to the
first chat completion, with an empty compile cache; with --engine, the same in a fresh Python
process without HTTP (`Engine.from_pretrained` and one `generate`: the GPU machine has no HTTP
stack), and also when the background warm-up finishes, with the seconds jax spent tracing,
lowering and compiling and the program store's loads and writes (summed over the compile
threads). --restart: then a second start on the compile cache the first filled (a restart), its
figures under "restart".

    python scripts/bench_startup.py --model smollm2-135m --out startup.json
    python scripts/bench_startup.py --engine --restart --model llama3-8b-random --out startup.json -- --warmup=full
    python scripts/bench_startup.py --engine --cache-dir /tmp/c ...  # twice: cold, then a restart

The server's own log (weights, lowering, compiling) is kept beside the JSON as startup.log.
Flags after `--` go to forkjax.serve (e.g. `-- --warmup full`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request


def _get(url: str, body: dict | None = None, timeout: float = 2.0):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


# --engine: run in a fresh interpreter, so imports and compiles all count.
_ENGINE = r"""
import json, sys, time
t0 = time.perf_counter()
import jax
jax.config.update("jax_compilation_cache_dir", sys.argv[2])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
import forkjax
from forkjax.runtime.compiler import CompileTimes
times = CompileTimes()
from forkjax.engine.engine import WARMUP_MODES
model, warmup = sys.argv[1], WARMUP_MODES[sys.argv[3]]
engine = forkjax.Engine.from_pretrained(model, warmup=warmup, progress=False)
ready = time.perf_counter() - t0
if engine.tokenizer is not None and hasattr(engine.tokenizer, "tok"):
    prompt = engine.tokenizer.tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
else:
    prompt = list(range(3, 33))  # ids every vocabulary has
out = engine.generate([prompt], max_new_tokens=16)[0]
first = time.perf_counter() - t0
while not engine.runner.warm and warmup:
    time.sleep(0.1)
store = engine.runner.store
print(json.dumps(dict(ready_s=ready, first_answer_s=first, warm_s=time.perf_counter() - t0,
                      answer=engine.tokenizer.decode(out) if engine.tokenizer else out,
                      backend=jax.default_backend(),
                      compile={k: round(v, 1) for k, v in times.totals.items()},
                      programs=dict(loaded=store.loaded, load_s=round(store.load_s, 1), written=store.saved,
                                    write_s=round(store.save_s, 1)) if store else None)))
"""


def engine_startup(args, cache: str, log) -> dict:
    warmup = next((a.split("=")[1] for a in args.args if a.startswith("--warmup=")), "background")
    run = subprocess.run([sys.executable, "-c", _ENGINE, args.model, cache, warmup],
                         stdout=subprocess.PIPE, stderr=log, text=True, timeout=args.limit)
    if run.returncode:
        sys.exit(f"the engine exited with {run.returncode}: see the log")
    return dict(json.loads(run.stdout.strip().splitlines()[-1]), warmup=warmup)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--out", default="startup.json")
    ap.add_argument("--limit", type=float, default=600,
                    help="seconds to wait for the server (with --engine: for the engine's process)")
    ap.add_argument("--engine", action="store_true", help="in-process engine, no HTTP server")
    ap.add_argument("--restart", action="store_true", help="a second start on the first's compile cache")
    ap.add_argument("--cache-dir", help="a compile cache folder to start on and keep (default: an "
                    "empty temporary one); a second run on the same folder is a restart")
    ap.add_argument("args", nargs="*", help="more flags for forkjax.serve (after --)")
    args = ap.parse_args()
    start = engine_startup if args.engine else server_startup
    if args.cache_dir is not None:
        os.makedirs(args.cache_dir, exist_ok=True)
    kept = tempfile.TemporaryDirectory() if args.cache_dir is None else contextlib.nullcontext(args.cache_dir)
    with kept as cache, open(os.path.splitext(args.out)[0] + ".log", "w") as log:
        files = sum(len(f) for _, _, f in os.walk(cache))  # 0: a cold start
        result = dict(start(args, cache, log), model=args.model, mode="engine" if args.engine else "server",
                      cache_files_before=files, cpu_count=os.cpu_count(), command=" ".join(sys.argv))
        if args.restart:
            result["restart"] = start(args, cache, log)
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


def server_startup(args, cache: str, log) -> dict:
    """Launch the server on compile cache `cache`: seconds to /health and to the first answer."""
    base = f"http://127.0.0.1:{args.port}"
    t0 = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "forkjax.serve", "--model", args.model,
                               "--port", str(args.port), "--compilation-cache-dir", cache,
                               *args.args], stdout=log, stderr=subprocess.STDOUT)
    try:
        ready = None
        while ready is None and time.perf_counter() - t0 < args.limit:
            if server.poll() is not None:
                sys.exit(f"the server exited with {server.returncode}: see {log.name}")
            try:
                _get(base + "/health")
                ready = time.perf_counter() - t0
            except OSError:
                time.sleep(0.25)
        if ready is None:
            sys.exit(f"no answer from /health within {args.limit} s: see {log.name}")
        reply = _get(base + "/v1/chat/completions", {
            "model": args.model, "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]},
            timeout=args.limit)
        first = time.perf_counter() - t0
    finally:
        server.terminate()
        server.wait(60)
    return dict(ready_s=ready, first_answer_s=first, answer=reply["choices"][0]["message"]["content"])


if __name__ == "__main__":
    main()
