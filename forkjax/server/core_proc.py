"""The engine-core process: the one owner of the Engine and the device, running the step loop
and answering the front ends' messages (messages.py) between steps (vLLM's EngineCoreProc).

A front end's message waits at most one step: an abort takes effect before the next prefill
chunk is scheduled. A `Score` runs as a request of the loop, chunk by chunk beside the others,
and is answered when it finishes (or dropped when its front end aborts it). The loop blocks on
its input socket only while the engine has nothing to do. Each step's new tokens go back
batched: one `Outputs` per front end that had a request make progress.

Unloading (or replacing) an adapter waits until the requests running on it finish. The loop
keeps stepping meanwhile, so every other request keeps flowing. Requests for that adapter that
arrive during the wait are held and admitted after the change (a removed adapter then answers
"not found"). A request that fans out to the adapter (writes its residual KV) counts as one on
it: after the swap it would write the slot's new weights under the old adapter's key. Adapter
files are read and checked on a worker thread, so a slow disk never stalls a step.

`StopRequests` (a front end is stopping) aborts that front end's requests: the running and
queued ones end with finish reason "shutdown", its held and later submits are refused as
"shutdown". The process ignores SIGINT and SIGTERM: its front end drains first and then sends
`Shutdown`. It exits by itself when the process that started it is gone.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import numbers
import os
import signal
import sys
import time
from typing import Callable

import msgspec
import zmq

from forkjax.engine.sequence import Status
from forkjax.server import messages as m
from forkjax.server.logprobs import score_entries

log = logging.getLogger("forkjax.serve")
IDLE_POLL_MS = 1000  # how often the core checks that its parent lives
BUSY_POLL_MS = 20  # while an adapter file is being read: how soon the loop looks again


class ShuttingDown(Exception):
    """The front end is stopping: the request was not admitted."""


def error_kind(e: BaseException) -> m.ErrorKind:
    if isinstance(e, ShuttingDown):
        return "shutdown"
    if isinstance(e, KeyError):
        return "not_found"
    return "invalid" if isinstance(e, ValueError) else "error"


@dataclasses.dataclass(eq=False)
class Handle:
    """One running choice of a front end's request."""
    client: int
    rid: int
    index: int
    seq: object  # engine Sequence
    sent: int = 0  # output tokens already sent
    failure: Exception | None = None  # set when the engine itself failed under this request
    stopped: bool = False  # aborted at a stop string found by the front end: it ends "stop"
    shut_down: bool = False  # aborted because its front end is stopping: it ends "shutdown"


@dataclasses.dataclass(eq=False)
class _Scoring:
    """A front end's Score call, run as a request of the step loop: answered when it finishes."""
    msg: m.Score
    seq: object  # engine Sequence
    failure: Exception | None = None  # why it ended early: its front end stopping, the engine failing


@dataclasses.dataclass(eq=False)
class _Barrier:
    """`action` runs once no request on adapter `msg.name` is live, then `msg` (a load or an
    unload) is answered; submits for that adapter wait here."""
    msg: m.LoadAdapter | m.UnloadAdapter
    action: Callable[[], object]
    held: list = dataclasses.field(default_factory=list)  # Submit messages deferred

    @property
    def name(self) -> str:
        return self.msg.name


class EngineCoreProc:
    def __init__(self, engine, inputs: zmq.Socket, context: zmq.Context, *, model_name: str = "",
                 tokenizer_source: tuple[str, str] | None = None,
                 parent_alive: Callable[[], bool] = lambda: True):
        self.engine, self.inputs, self.context = engine, inputs, context
        self.model_name, self.tokenizer_source = model_name, tokenizer_source
        self.outputs: dict[int, zmq.Socket] = {}  # front end -> the PUSH socket to it
        self.parent_alive = parent_alive
        self.live: dict[int, Handle] = {}  # seq.id -> handle
        self.by_request: dict[tuple[int, int], list[Handle]] = {}  # (client, rid) -> its choices
        self.scores: dict[tuple[int, int], _Scoring] = {}  # (client, call) -> its request
        self.barriers: list[_Barrier] = []
        self.stopping: set[int] = set()  # front ends whose requests are refused
        self.closing = False
        self.reads: list[tuple[concurrent.futures.Future, Callable]] = []  # adapter files
        self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="forkjax-adapters")
        self._poller = zmq.Poller()
        self._poller.register(inputs, zmq.POLLIN)

    # ---- the loop -------------------------------------------------------------------------

    def run(self):
        checked = time.monotonic()
        while not self.closing:
            busy = self.engine.scheduler.has_work
            self._serve_inputs(0 if busy else BUSY_POLL_MS if self.reads else IDLE_POLL_MS)
            if time.monotonic() - checked > IDLE_POLL_MS / 1000:
                checked = time.monotonic()
                if not self.parent_alive():
                    log.warning("the front end is gone: the engine core stops")
                    break
            self._finish_reads()
            if self.engine.scheduler.has_work:
                try:
                    self.engine.step()
                except Exception as e:  # an engine bug: fail the requests, keep serving
                    log.exception("engine step failed; failing the requests in flight")
                    self._fail_all(e)
            self._publish()
            self._answer_scores()
            self._release_barriers()
        self._reader.shutdown(wait=False, cancel_futures=True)

    def _serve_inputs(self, timeout_ms: int):
        """Handle every message waiting (waiting up to `timeout_ms` for the first)."""
        if not self._poller.poll(timeout_ms):
            return
        while True:
            try:
                data = self.inputs.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self.handle(m.decode_request(data))
            except Exception:
                log.exception("could not handle a front end's message")

    def handle(self, msg: m.Request):
        if isinstance(msg, m.Submit):
            self._submit(msg)
        elif isinstance(msg, m.Abort):
            self._abort(msg)
        elif isinstance(msg, m.Score):
            self._score(msg)
        elif isinstance(msg, m.LoadAdapter):
            self._load_adapter(msg)
        elif isinstance(msg, m.UnloadAdapter):
            if msg.name in self.engine.slots.by_name:
                self._after_drain(msg, lambda: self.engine.unload_adapter(msg.name))
            else:
                self.reply(msg, error=KeyError(f"The lora adapter '{msg.name}' cannot be found."))
        elif isinstance(msg, m.GetStats):
            self._call(msg, self._stats)
        elif isinstance(msg, m.FlushCache):
            self._call(msg, self.engine.flush_cache)
        elif isinstance(msg, m.StopRequests):
            self._stop_requests(msg.client)
        elif isinstance(msg, m.Hello):
            self.connect(msg.client, msg.address)
            self.send(msg.client, m.Ready(info=self.info()))
        elif isinstance(msg, m.Shutdown):
            self._stop_requests(msg.client)
            self.closing = True

    # ---- calls ----------------------------------------------------------------------------

    def connect(self, client: int, address: str):
        sock = self.context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(address)
        self.outputs[client] = sock

    def send(self, client: int, msg: m.Response):
        sock = self.outputs.get(client)
        if sock is not None:
            sock.send(m.encode(msg), copy=False)

    def reply(self, msg, result=None, error: BaseException | None = None):
        if error is None:
            self.send(msg.client, m.Reply(msg.call, result=result))
        else:
            text = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
            self.send(msg.client, m.Reply(msg.call, error=text, kind=error_kind(error),
                                          param=getattr(error, "param", None)))

    def _call(self, msg, fn: Callable[[], object]):
        """Answer `msg` with fn()'s result or error."""
        try:
            result = fn()
        except Exception as e:
            self.reply(msg, error=e)
        else:
            self.reply(msg, result)

    def info(self) -> m.EngineInfo:
        engine = self.engine
        stats = engine.stats()
        pages = min(n for n in (stats["base_pages_total"], stats["residual_pages_total"]) if n > 0)
        return m.EngineInfo(
            model=self.model_name, cache_policy=engine.config.cache_policy,
            max_model_len=engine.max_model_len, vocab_size=engine.model_cfg.vocab_size,
            max_lora_rank=engine.max_lora_rank, pool_tokens=(pages - 2) * engine.config.page_size,
            residual_fanout=engine.config.residual_fanout,
            tokenizer=self.tokenizer_source, adapters=self.adapters())

    def adapters(self) -> dict[str, str]:
        return {name: m.display_path(a.source) for name, a in self.engine.slots.by_name.items()}

    def _stats(self) -> dict:
        s = dict(self.engine.stats())
        s["waiting"] += sum(len(b.held) for b in self.barriers)
        s["adapters"] = len(self.engine.slots.by_name)
        # the scalars, as Python numbers (a numpy one has no msgpack form)
        return {k: v.item() if hasattr(v, "item") else v for k, v in s.items()
                if isinstance(v, (numbers.Number, str))}

    def _score(self, msg: m.Score):
        """Queue the prompt's scoring; the loop steps it chunk by chunk (serving every other
        message in between) and `_answer_scores` replies."""
        if msg.client in self.stopping:
            self.reply(msg, error=ShuttingDown("the server is shutting down"))
            return
        try:
            seq = self.engine.add_score_request(msg.prompt, msg.adapter, cache_salt=msg.cache_salt)
        except Exception as e:
            self.reply(msg, error=e)
            return
        self.scores[(msg.client, msg.call)] = _Scoring(msg, seq)

    def _answer_scores(self):
        for key, s in list(self.scores.items()):
            seq = s.seq
            if seq.status is not Status.FINISHED:
                continue
            del self.scores[key]
            error = s.failure or seq.error
            if error is not None:
                self.reply(s.msg, error=error)
            elif seq.finish_reason != "abort":  # aborted by its front end: nobody waits for it
                self._call(s.msg, lambda: [
                    [lp, top.tolist(), top_lps.tolist(), rank] for lp, top, top_lps, rank
                    in score_entries(self.engine.scored(seq), s.msg.prompt, s.msg.k)])

    # ---- adapters -------------------------------------------------------------------------

    def _load_adapter(self, msg: m.LoadAdapter):
        """Read and check the files off the loop, then install once the adapter is idle."""
        from forkjax.engine.loading import read_adapters
        engine = self.engine
        if msg.name in engine.slots.by_name and not msg.replace:
            self.reply(msg, error=ValueError(f"The lora adapter '{msg.name}' has already been "
                                             "loaded (set load_inplace to replace it)."))
            return

        def read():
            adapter, = read_adapters({msg.name: msg.path}, engine.model_cfg)
            if adapter.rank > engine.max_lora_rank:
                raise ValueError(f"adapter '{msg.name}' has rank {adapter.rank} > the server's max "
                                 f"LoRA rank {engine.max_lora_rank} (--max-lora-rank)")
            return adapter

        def install(adapter):
            if msg.name in engine.slots.by_name and not msg.replace:  # loaded meanwhile
                raise ValueError(f"The lora adapter '{msg.name}' has already been loaded.")
            engine.load_adapter(msg.name, adapter, pinned=msg.pinned)

        def then(future: concurrent.futures.Future):
            try:
                adapter = future.result()
            except Exception as e:  # whatever is wrong with the files came with the request
                why = str(e).removeprefix(f"adapter {msg.name!r}: ")  # the loader names it too
                self.reply(msg, error=ValueError(f"cannot load adapter '{msg.name}': {why}"))
                return
            self._after_drain(msg, lambda: install(adapter))
        self.reads.append((self._reader.submit(read), then))

    def _finish_reads(self):
        for item in [r for r in self.reads if r[0].done()]:
            self.reads.remove(item)
            item[1](item[0])

    def _after_drain(self, msg, action: Callable[[], object]):
        """Run `action` once no request uses adapter `msg.name`, then answer `msg` with the
        adapters loaded."""
        self.barriers.append(_Barrier(msg, action))

    def _release_barriers(self):
        for b in list(self.barriers):
            if any(self._uses(r.seq, b.name) for r in (*self.live.values(), *self.scores.values())):
                continue
            self.barriers.remove(b)
            try:
                b.action()
            except Exception as e:
                self.reply(b.msg, error=e)
            else:
                self.reply(b.msg, self.adapters())
            for held in b.held:
                self._submit(held)

    def _uses(self, seq, name: str) -> bool:
        """Whether `seq` runs on adapter `name` or writes its residuals."""
        return seq.adapter == name or name in seq.targets.values()

    def _would_use(self, msg: m.Submit, name: str) -> bool:
        if msg.adapter == name:
            return True
        if msg.fanout_adapters is None:
            return self.engine.config.residual_fanout
        return name in msg.fanout_adapters

    # ---- requests -------------------------------------------------------------------------

    def _submit(self, msg: m.Submit):
        if msg.client in self.stopping:
            self.reply(msg, error=ShuttingDown("the server is shutting down"))
            return
        held = next((b for b in self.barriers if self._would_use(msg, b.name)), None)
        if held is not None:
            held.held.append(msg)
            return
        handles = []
        try:
            for i, choice in enumerate(msg.choices):
                seq = self.engine.add_request(
                    choice.prompt, msg.adapter, choice.params, session_id=msg.session_id,
                    session_end=msg.session_end, session_tokens=msg.session_tokens,
                    session_next_s=msg.session_next_s, fanout_adapters=msg.fanout_adapters,
                    cache_salt=msg.cache_salt)
                handles.append(Handle(msg.client, msg.rid, i, seq))
        except Exception as e:
            for h in handles:
                self.engine.abort(h.seq)
            self.reply(msg, error=e)
            return
        for h in handles:
            self.live[h.seq.id] = h
        self.by_request[(msg.client, msg.rid)] = handles
        self.reply(msg)

    def _abort(self, msg: m.Abort):
        scoring = self.scores.get((msg.client, msg.rid))
        if scoring is not None:
            self.engine.abort(scoring.seq)
        for h in self.by_request.get((msg.client, msg.rid), ()):
            if (msg.indices is None or h.index in msg.indices) and h.seq.id in self.live:
                h.stopped = msg.stop
                self.engine.abort(h.seq)

    def _stop_requests(self, client: int):
        self.stopping.add(client)
        for h in self.live.values():
            if h.client == client:
                h.shut_down = True
                self.engine.abort(h.seq)
        for (owner, _), s in self.scores.items():
            if owner == client:
                s.failure = ShuttingDown("the server is shutting down")
                self.engine.abort(s.seq)
        for b in self.barriers:
            mine = [s for s in b.held if s.client == client]
            b.held = [s for s in b.held if s.client != client]
            for s in mine:
                self.reply(s, error=ShuttingDown("the server is shutting down"))

    def _fail_all(self, error: Exception):
        for h in (*self.live.values(), *self.scores.values()):
            h.failure = error
            try:
                self.engine.abort(h.seq)
            except Exception:
                log.exception("could not abort request %d", h.seq.id)

    def _publish(self):
        """Every live choice's new tokens (and its end), one Outputs message per front end."""
        batches: dict[int, list[m.Output]] = {}
        for sid, h in list(self.live.items()):
            seq = h.seq
            done = seq.status is Status.FINISHED
            n = len(seq.output)
            if n == h.sent and not done:
                continue
            out = m.Output(h.rid, h.index, list(seq.output[h.sent:n]))
            if h.sent == 0:  # its prompt is in the cache by its first token
                out.cached_tokens = seq.num_cached
            if seq.params.logprobs is not None:
                out.logprobs = [[lp, top.tolist(), lps.tolist()]
                                for lp, top, lps in seq.output_logprobs[h.sent:n]]
            h.sent = n
            if done:
                self._finish(sid, h, out)
            batches.setdefault(h.client, []).append(out)
        for client, outs in batches.items():
            self.send(client, m.Outputs(outs))

    def _finish(self, sid: int, h: Handle, out: m.Output):
        seq = h.seq
        del self.live[sid]
        siblings = self.by_request[(h.client, h.rid)]
        siblings.remove(h)
        if not siblings:
            del self.by_request[(h.client, h.rid)]
        reason, error = seq.finish_reason, seq.error
        if h.failure is not None:
            reason, error = "error", h.failure
        elif h.stopped and reason == "abort":
            reason = "stop"
        elif h.shut_down and reason == "abort":
            reason = "shutdown"
        out.finish_reason = reason
        if error is not None:
            out.kind = error_kind(error)
            out.error = str(error) if out.kind == "invalid" else repr(error)
        if seq.first_admitted is not None:
            out.queued_s = seq.first_admitted - seq.arrival


# ---- the process ----------------------------------------------------------------------------

def main():
    """`python -m forkjax.server.core_proc` with a messages.CoreSpec (msgpack) on its stdin:
    what the front end spawns (core_client.py)."""
    spec = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=m.CoreSpec)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s:     %(name)s: %(message)s")
    logging.getLogger("forkjax").setLevel(spec.log_level.upper())
    from forkjax.engine import memory
    memory.reserve_pinned_host(spec.engine_kwargs.get("host_kv_bytes"))  # before jax's GPU client
    import jax
    if spec.compilation_cache_dir and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir", spec.compilation_cache_dir)
    # Every program, however quick to compile: a restart then compiles none of them.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.bind(spec.input_address)
    core = EngineCoreProc(None, inputs, context, model_name=m.display_path(spec.model),
                          parent_alive=lambda: os.getppid() == spec.parent_pid)
    core.connect(spec.client, spec.output_address)
    print(f"forkjax: loading {spec.model} ({spec.engine_kwargs.get('dtype')}, cache policy "
          f"{spec.engine_kwargs.get('cache_policy')}) on {jax.default_backend()}", file=sys.stderr,
          flush=True)
    try:
        core.engine, core.tokenizer_source = load_engine(spec)
    except (OSError, ValueError) as e:  # bad flags or files: said in one line, no traceback
        core.send(spec.client, m.Ready(error=str(e)))
        context.destroy(linger=1000)
        sys.exit(1)
    core.send(spec.client, m.Ready(info=core.info()))
    try:
        core.run()
    finally:
        core.engine.close()
        context.destroy(linger=1000)


def load_engine(spec: m.CoreSpec):
    """-> (the Engine, how the front end builds its tokenizer: EngineInfo.tokenizer)."""
    import forkjax
    from forkjax.engine.engine import WARMUP_MODES
    from forkjax.engine.loading import tokenizer_source
    kwargs = dict(spec.engine_kwargs)
    kwargs["warmup"] = WARMUP_MODES[kwargs.get("warmup", "background")]
    engine = forkjax.Engine.from_pretrained(spec.model, **kwargs)
    return engine, tokenizer_source(spec.model, engine.tokenizer)


if __name__ == "__main__":
    main()
