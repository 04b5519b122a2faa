"""Server start-up: seconds from launching `python -m forkjax.serve` to /health answering and to
the first chat completion, with an empty compile cache.

    python scripts/bench_startup.py --model smollm2-135m --out startup.json

The server's own log (weights, lowering, compiling) is kept beside the JSON as startup.log.
"""

from __future__ import annotations

import argparse
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--out", default="startup.json")
    ap.add_argument("--limit", type=float, default=600, help="seconds to wait for the server")
    ap.add_argument("args", nargs="*", help="more flags for forkjax.serve (after --)")
    args = ap.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    log_path = os.path.splitext(args.out)[0] + ".log"
    with tempfile.TemporaryDirectory() as cache, open(log_path, "w") as log:
        t0 = time.perf_counter()
        server = subprocess.Popen([sys.executable, "-m", "forkjax.serve", "--model", args.model,
                                   "--port", str(args.port), "--compilation-cache-dir", cache,
                                   *args.args], stdout=log, stderr=subprocess.STDOUT)
        try:
            ready = None
            while ready is None and time.perf_counter() - t0 < args.limit:
                if server.poll() is not None:
                    sys.exit(f"the server exited with {server.returncode}: see {log_path}")
                try:
                    _get(base + "/health")
                    ready = time.perf_counter() - t0
                except OSError:
                    time.sleep(0.25)
            if ready is None:
                sys.exit(f"no answer from /health within {args.limit} s: see {log_path}")
            reply = _get(base + "/v1/chat/completions", {
                "model": args.model, "max_tokens": 16, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]},
                timeout=args.limit)
            first = time.perf_counter() - t0
        finally:
            server.terminate()
            server.wait(60)
    result = dict(model=args.model, ready_s=ready, first_answer_s=first, cpu_count=os.cpu_count(),
                  answer=reply["choices"][0]["message"]["content"], command=" ".join(sys.argv))
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
