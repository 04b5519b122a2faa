"""Serve an Engine over HTTP on a loopback port from a background thread.

The HTTP benchmark drives this server through `http_driver` exactly as it would a separate
`python -m forkjax.serve` (the same app and engine thread), while keeping hold of the engine for
what the HTTP API has no endpoint for: flushing the cache and resetting the counters between
runs. Those run on the engine thread, between steps, through `EngineLoop.call`, since the engine
is not thread-safe.
"""

from __future__ import annotations

import threading
import time

import uvicorn

from forkjax.server.app import create_app
from forkjax.server.engine_loop import EngineLoop


class LocalServer:
    def __init__(self, engine, model_name: str, start_timeout_s: float = 60.0):
        self.loop = EngineLoop(engine)
        app = create_app(self.loop, model_name=model_name, model_root=model_name,
                         max_lora_rank=engine.max_lora_rank)
        # Port 0: the OS picks a free one; uvicorn runs its own asyncio loop in this thread.
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self._thread = threading.Thread(target=self.server.run, name="forkjax-http", daemon=True)
        self._start_timeout_s = start_timeout_s
        self.url = ""

    def __enter__(self) -> "LocalServer":
        self.loop.start()
        self._thread.start()
        deadline = time.monotonic() + self._start_timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.loop.shutdown()
                raise RuntimeError("the local HTTP server did not start")
            time.sleep(0.01)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self

    def call(self, fn):
        """fn() on the engine thread between steps; its result."""
        return self.loop.call(fn).result()

    def __exit__(self, *exc):
        self.server.should_exit = True
        self._thread.join(timeout=10)
        self.loop.shutdown()
