"""The front end's side of the engine-core process (core_proc.py): spawns it, sends it
messages (messages.py) and routes what comes back to the requests waiting for it (vLLM's
AsyncMPClient).

Sends never block (PUSH with no high-water mark), so a handler may send from synchronous code
(an abort in a `finally`). Outputs arrive on one asyncio task that puts each on its request's
queue. When the core process dies, every open request gets a "shutdown" output (503, or an
error event on a stream), new ones are refused with 503, and `on_death` tells the server to
exit with an error status, so that a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Callable

import msgspec
import zmq
import zmq.asyncio

from forkjax.server import messages as m

START_POLL_MS = 500  # while the core loads: how often the front end checks that it lives


class CoreError(Exception):
    """A call or submit the core refused or failed: `kind` says how (messages.ErrorKind),
    `param` which field of the request was at fault, where the core said."""

    def __init__(self, kind: m.ErrorKind, message: str, param: str | None = None):
        super().__init__(message)
        self.kind, self.param = kind, param


class CoreDied(RuntimeError):
    """The engine-core process ended before it was told to."""


@dataclasses.dataclass(eq=False)
class RequestStream:
    """One submitted request's outputs, and what its latency histograms need."""
    queue: asyncio.Queue
    choices: int
    arrival: float  # time.monotonic() when the front end took the request
    open: int = 0  # choices not finished yet
    last: dict = dataclasses.field(default_factory=dict)  # choice -> when its last tokens came


class CoreClient:
    def __init__(self, context: zmq.Context, process, push: zmq.Socket, pull: zmq.Socket,
                 info: m.EngineInfo, workdir: str, client: int = 0):
        self.context, self.process, self.info, self.workdir = context, process, info, workdir
        self.client = client
        self._push, self._sync_pull = push, pull
        self._pull: zmq.asyncio.Socket | None = None
        self._calls: dict[int, asyncio.Future] = {}
        self._streams: dict[int, RequestStream] = {}
        self._ids = itertools.count(1)
        self._receiver: asyncio.Task | None = None
        self._pidfd = -1
        self.adapters: dict[str, str] = dict(info.adapters)  # replaced whole, never mutated
        self.dead: str | None = None  # why the core is gone
        self.on_death: Callable[[], None] = lambda: None
        self.on_output: Callable[[RequestStream, m.Output, float], None] = lambda *a: None

    # ---- start and stop (synchronous: before and after the server's event loop) ---------

    @classmethod
    def spawn(cls, model: str, engine_kwargs: dict, **spec_fields) -> "CoreClient":
        """Start `python -m forkjax.server.core_proc` for `model` (messages.CoreSpec: the
        engine's keywords and the rest of `spec_fields`) and wait until its engine is loaded.
        Raises CoreDied, or ValueError with the core's own message where it refused the model
        or the flags."""
        workdir = tempfile.mkdtemp(prefix="forkjax-")
        spec = m.CoreSpec(model=model, engine_kwargs=engine_kwargs, parent_pid=os.getpid(),
                          input_address=f"ipc://{workdir}/core",
                          output_address=f"ipc://{workdir}/client-0", **spec_fields)
        context = zmq.Context()
        pull = context.socket(zmq.PULL)
        pull.bind(spec.output_address)
        process = subprocess.Popen([sys.executable, "-m", "forkjax.server.core_proc"],
                                   stdin=subprocess.PIPE)
        try:
            process.stdin.write(msgspec.msgpack.encode(spec))
            process.stdin.close()
            while not pull.poll(START_POLL_MS):
                if process.poll() is not None:
                    raise CoreDied(f"the engine core exited with status {process.returncode} while loading")
            ready = m.decode_response(pull.recv())
            if ready.error is not None:
                raise ValueError(ready.error)
        except BaseException:
            _stop(process)
            context.destroy(linger=0)
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 0)
        push.setsockopt(zmq.LINGER, 1000)
        push.connect(spec.input_address)
        return cls(context, process, push, pull, ready.info, workdir)

    def shutdown(self, timeout_s: float = 30.0):
        """Stop the core (its requests end) and wait for it; kill it after `timeout_s`."""
        if self.dead is None and self.process.poll() is None:
            self._send(m.Shutdown(self.client))
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        _stop(self.process)
        self.context.destroy(linger=0)
        shutil.rmtree(self.workdir, ignore_errors=True)

    # ---- in the server's event loop -------------------------------------------------------

    async def start(self):
        """Route the core's messages and watch its process (from the app's lifespan)."""
        loop = asyncio.get_running_loop()
        self._pull = zmq.asyncio.Socket.from_socket(self._sync_pull)
        self._receiver = loop.create_task(self._receive())
        self._pidfd = os.pidfd_open(self.process.pid)  # readable once the process has ended
        loop.add_reader(self._pidfd, self._died)

    async def stop(self):
        asyncio.get_running_loop().remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._receiver.cancel()

    def stop_requests(self):
        """This front end is stopping: the core ends its requests with "shutdown"."""
        self._send(m.StopRequests(self.client))

    async def submit(self, choices: list[m.Choice], **fields) -> tuple[int, RequestStream]:
        """Queue one request's choices -> (its id, its stream); CoreError if refused."""
        rid = next(self._ids)
        stream = RequestStream(asyncio.Queue(), len(choices), time.monotonic(), len(choices))
        self._streams[rid] = stream
        try:
            await self._call(m.Submit, rid=rid, choices=choices, **fields)
        except BaseException:
            self._streams.pop(rid, None)
            raise
        return rid, stream

    def abort(self, rid: int, indices: list[int] | None = None, stop: bool = False):
        if self.dead is None:
            self._send(m.Abort(self.client, rid, indices, stop))

    async def call(self, kind: type, **fields):
        """A call (Score, LoadAdapter, UnloadAdapter, GetStats, FlushCache) -> its result."""
        result = await self._call(kind, **fields)
        if kind in (m.LoadAdapter, m.UnloadAdapter):
            self.adapters = result
        return result

    async def _call(self, kind: type, **fields):
        if self.dead is not None:
            raise CoreError("shutdown", self.dead)
        call = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call] = future
        try:
            self._send(kind(client=self.client, call=call, **fields))
            return await future
        except asyncio.CancelledError:
            if kind is m.Score:  # its client left: the core stops computing it
                self.abort(call)
            raise
        finally:
            self._calls.pop(call, None)

    def _send(self, msg: m.Request):
        self._push.send(m.encode(msg), zmq.NOBLOCK, copy=False)

    async def _receive(self):
        while True:
            msg = m.decode_response(await self._pull.recv())
            if isinstance(msg, m.Outputs):
                now = time.monotonic()
                for out in msg.outputs:
                    self._deliver(out, now)
            elif isinstance(msg, m.Reply):
                future = self._calls.get(msg.call)
                if future is not None and not future.done():
                    if msg.error is None:
                        future.set_result(msg.result)
                    else:
                        future.set_exception(CoreError(msg.kind, msg.error, msg.param))

    def _deliver(self, out: m.Output, now: float):
        stream = self._streams.get(out.rid)
        if stream is None:
            return
        self.on_output(stream, out, now)
        if out.finish_reason is not None:
            stream.open -= 1
            if not stream.open:
                del self._streams[out.rid]
        stream.queue.put_nowait(out)

    def _died(self):
        asyncio.get_running_loop().remove_reader(self._pidfd)
        self.dead = f"the engine core process died (exit status {self.process.wait()})"
        for rid, stream in list(self._streams.items()):
            for index in range(stream.choices):
                stream.queue.put_nowait(m.Output(rid, index, [], finish_reason="error",
                                                 error=self.dead, kind="shutdown"))
        self._streams.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(CoreError("shutdown", self.dead))
        self.on_death()


def _stop(process: subprocess.Popen):
    if process.poll() is None:
        process.kill()
    process.wait(10)


def load_tokenizer(source: tuple[str, str] | None):
    """The model's tokenizer as EngineInfo.tokenizer says to build it (None: it has none)."""
    from forkjax.tokenizer import ByteTokenizer, HFTokenizer
    if source is None:
        return None
    kind, path = source
    if kind == "byte":
        return ByteTokenizer()
    if kind == "gguf":
        from forkjax.models.gguf import GGUFCheckpoint  # numpy only
        return GGUFCheckpoint(path).tokenizer()
    return HFTokenizer(path)
