"""A scripted engine behind a real `EngineCoreProc` on a thread, over real ZeroMQ sockets: the
engine-core protocol and the HTTP front end tested in milliseconds, without JAX or a model."""

from __future__ import annotations

import collections
import subprocess
import sys
import threading
import time
import types

import zmq

from forkjax.cache.policy import salted
from forkjax.engine.sequence import Request, Sequence, Status
from forkjax.server import messages as m
from forkjax.server.core_client import CoreClient
from forkjax.server.core_proc import EngineCoreProc


class ScriptedEngine:
    """Every step (2 ms) appends token 7 to each running request; `fail_next` makes one raise.
    Enough of the Engine for the core and the app (config, stats, adapters, flush)."""

    def __init__(self, cache_policy="forkkv"):
        self.waiting, self.running = collections.deque(), []
        self.adapters = {"a": object(), "b": object()}
        self.fail_next = False
        self.scheduler = self
        self.slots = self
        self.config = types.SimpleNamespace(cache_policy=cache_policy, residual_fanout=False, page_size=16)
        self.tokenizer, self.max_model_len, self.max_lora_rank = None, 1024, 16
        self.model_cfg = types.SimpleNamespace(vocab_size=512)
        self.added: list[Sequence] = []
        self.flushed_on: list[str] = []  # threads flush_cache ran on

    @property
    def has_work(self):
        return bool(self.waiting or self.running)

    @property
    def by_name(self):
        return {n: types.SimpleNamespace(source=n) for n in self.adapters}

    def add_request(self, prompt, adapter, params, *, session_id=None, session_end=False,
                    session_tokens=None, session_next_s=None, fanout_adapters=None, cache_salt=None):
        if adapter is not None and adapter not in self.adapters:
            raise KeyError(adapter)
        if not prompt:
            raise ValueError("empty prompt")
        fanout = {n: n for n in fanout_adapters or () if self.by_name[n]}  # KeyError for an unknown one
        # the salt is folded into the cache key (adapter_key), as the engine does
        seq = Sequence(Request(tuple(prompt), adapter, salted(adapter, cache_salt), params,
                               session_id=session_id, session_end=session_end,
                               session_tokens=session_tokens, session_next_s=session_next_s,
                               fanout=tuple(fanout.items())))
        self.waiting.append(seq)
        self.added.append(seq)
        return seq

    def step(self):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("device on fire")
        time.sleep(0.002)
        while self.waiting:
            seq = self.waiting.popleft()
            seq.status = Status.RUNNING
            seq.first_admitted = time.monotonic()
            self.running.append(seq)
        for seq in list(self.running):
            seq.output.append(7)
            if len(seq.output) >= seq.params.max_new_tokens:
                self.abort(seq, "length")

    def abort(self, seq, reason="abort"):
        for q in (self.waiting, self.running):
            if seq in q:
                q.remove(seq)
        seq.finish(reason)

    def unload_adapter(self, name):
        assert not any(s.adapter == name or name in s.targets.values() for s in self.running), \
            "unloaded under a running request"
        del self.adapters[name]

    def stats(self):
        return {"base_pages_total": 64, "residual_pages_total": 64, "running": len(self.running),
                "waiting": len(self.waiting), "prompt_tokens": 0}

    def flush_cache(self):
        self.flushed_on.append(threading.current_thread().name)
        return 3


class ScriptedCore:
    """`EngineCoreProc` over `engine` on a thread named forkjax-core, bound in `workdir`."""

    def __init__(self, engine, workdir):
        self.engine, self.workdir = engine, str(workdir)
        self.context = zmq.Context()
        inputs = self.context.socket(zmq.PULL)
        inputs.bind(self.input_address)
        self.core = EngineCoreProc(engine, inputs, self.context, model_name="base")
        self.thread = threading.Thread(target=self.core.run, name="forkjax-core", daemon=True)

    @property
    def input_address(self) -> str:
        return f"ipc://{self.workdir}/core"

    def poke(self):
        """Wake an idle core (a message it ignores: an abort of nothing)."""
        sock = self.context.socket(zmq.PUSH)
        sock.connect(self.input_address)
        sock.send(m.encode(m.Abort(99, -1)))
        sock.close(linger=1000)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.core.closing = True
        self.poke()
        self.thread.join(10)
        assert not self.thread.is_alive()
        self.context.destroy(linger=0)


class Peer:
    """A front end speaking the raw protocol: sends requests, reads responses."""

    def __init__(self, core: ScriptedCore, client: int):
        self.client = client
        self.pull = core.context.socket(zmq.PULL)
        address = f"ipc://{core.workdir}/client-{client}"
        self.pull.bind(address)
        self.push = core.context.socket(zmq.PUSH)
        self.push.connect(core.input_address)
        self.send(m.Hello(client, address))
        ready = self.recv()
        assert isinstance(ready, m.Ready) and ready.info.model == "base"
        self.info = ready.info
        self.replies: dict[int, m.Reply] = {}
        self.outputs: list[m.Output] = []

    def send(self, msg):
        self.push.send(m.encode(msg))

    def recv(self, timeout_s: float = 5):
        assert self.pull.poll(int(timeout_s * 1000)), "nothing came back"
        msg = m.decode_response(self.pull.recv())
        if isinstance(msg, m.Reply):
            self.replies[msg.call] = msg
        elif isinstance(msg, m.Outputs):
            self.outputs += msg.outputs
        return msg

    def reply(self, call: int, timeout_s: float = 10) -> m.Reply:
        deadline = time.monotonic() + timeout_s
        while call not in self.replies:
            self.recv(max(deadline - time.monotonic(), 0.01))
        return self.replies.pop(call)

    def until_finished(self, rid: int, choices: int = 1, timeout_s: float = 10) -> list[m.Output]:
        deadline = time.monotonic() + timeout_s
        while sum(o.finish_reason is not None for o in self.outputs if o.rid == rid) < choices:
            self.recv(max(deadline - time.monotonic(), 0.01))
        return [o for o in self.outputs if o.rid == rid]


def front_end(core: ScriptedCore) -> CoreClient:
    """A CoreClient attached to `core` as front end 1. Its "process" is a child that sleeps:
    killing it is what the client sees when its core dies."""
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    address = f"ipc://{core.workdir}/client-1"
    pull.bind(address)
    push = context.socket(zmq.PUSH)
    push.connect(core.input_address)
    push.send(m.encode(m.Hello(1, address)))
    assert pull.poll(5000)
    info = m.decode_response(pull.recv()).info
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    return CoreClient(context, stand_in, push, pull, info, workdir=str(core.workdir), client=1)
