"""`python -m forkjax.serve`: an OpenAI-compatible server where every LoRA adapter is a model.

    python -m forkjax.serve                         # tiny-llama + demo adapters on 127.0.0.1:8000
    python -m forkjax.serve --model /ckpt/llama --lora planner=/ckpt/planner --lora coder=/ckpt/coder \\
        --cache-policy forkkv --api-key sk-local

Endpoints (vLLM's names and bodies): /v1/completions, /v1/chat/completions (`stream: true` for
server-sent events; `model` picks the adapter, the base model answers to its own name),
/v1/models, /v1/models/{id}, /v1/load_lora_adapter, /v1/unload_lora_adapter, /tokenize,
/detokenize, /health, /metrics (Prometheus), /version, and SGLang's POST /flush_cache (frees
every KV page no running request holds). --api-key guards /v1, /flush_cache, /tokenize and
/detokenize.

Both generation endpoints take vLLM's `cache_salt` (requests share cached pages only within one
salt) and forkjax fields: `session_id` (the requests of one workflow: whole workflows are
admitted as they fit, and a workflow's pages are kept between its turns until a request with
`session_end` finishes or it has been idle for --session-ttl seconds; `session_tokens` hints its
final length) and `fanout_adapters` (forkkv: the agents whose residual KV the request also
writes, so their forks of its prefix are full hits; null follows --residual-fanout, on by
default under forkkv: the other adapters in device slots; [] writes none). A server started
with --no-residual-fanout runs programs of their own for a batch with a request that fans out
(--warmup compiles them after the plain ones). --schedule-policy picks
the admission order (lpm: cached prefixes first, with a bounded wait; fifo), --residual-fraction
the residual pool's share of --kv-cache-bytes (or --residual-copies: room for that many
adapters' residuals of each cached token).
--deterministic fixes every step's shapes, so a request's logits (bitwise) and greedy tokens do
not depend on what runs beside it, on its prompt's chunking or on prefix hits (buckets.py).
--warmup: the step programs (those of fan-out and scoring too) and the sampling programs
(runtime/warmup_plan.py) compile in the background while the server already answers (default:
a request compiles the shapes it needs first), all before serving (full), or when a request
first needs them (none).

The engine runs in a process of its own (forkjax/server/core_proc.py), which owns the device
and steps without waiting on HTTP work; this process, the front end, validates, tokenizes,
detokenizes and streams, and speaks to the engine only through forkjax/server/messages.py. If
the engine's process dies, requests get 503 and the server exits with status 1 within seconds,
for a supervisor to restart it. This file parses flags, starts the engine core and runs uvicorn.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import signal
import sys
import threading

import uvicorn

from forkjax.server.app import create_app
from forkjax.server.core_client import CoreClient, CoreDied
from forkjax.server.messages import display_path
from forkjax.server.middleware import GUARDED_PREFIXES
from forkjax.sizes import size_flag

DEFAULT_MAX_BODY = 8 << 20
# Requests still running when --shutdown-timeout passes are aborted and answered with an error;
# uvicorn cancels those whose answer has not gone out this much later (a stuck client or step).
ABORT_GRACE_S = 5.0
# Once the engine core has died, new requests get 503 this long before the server exits: a
# client or load balancer sees why, rather than a refused connection.
DEATH_GRACE_S = 2.0
WARMUP = ("background", "full", "none")  # the engine's warmup True / "background" / False


def parse_lora(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora {text!r}: expected NAME=DIR")
    return _utf8(name), path


def _utf8(text: str) -> str:
    """A name the API shows must be valid Unicode (argv may carry undecodable bytes)."""
    if display_path(text) != text:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid UTF-8")
    return text


class _Parser(argparse.ArgumentParser):
    """argparse with errors on one line: the usage of 30 flags would bury the message."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see --help\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m forkjax.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llama",
                   help="the model to serve: an HF checkpoint directory, a .gguf file or a built-in "
                        "model name (default: %(default)s, a tiny random-weight Llama served with "
                        "the demo adapters; smollm2-135m: the real SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", type=_utf8, default=None,
                   help="the base model's name in the API (default: --model)")
    p.add_argument("--lora", action="append", type=parse_lora, default=[], metavar="NAME=DIR",
                   help="a PEFT adapter to serve as model NAME (repeatable; replaces the demo adapters)")
    p.add_argument("--cache-policy", default="forkkv",
                   choices=("forkkv", "prefix", "full_reuse", "lrshared"),
                   help="how adapters share cached K/V. forkkv, the default because memory bounds "
                        "how many agents run at once: agents on one context share one base K/V "
                        "cache plus a small residual each, about one copy for N agents instead "
                        "of N; approximate: an agent forking another's prefix attends to K/V from "
                        "that agent's hidden states (the built-in trained agents answer 0.451 "
                        "right against 0.617 exact: BENCHMARKS.md, Fidelity). prefix: exact, each "
                        "adapter reuses only its own prefixes, N copies. full_reuse, lrshared: "
                        "docs/design.md. `python -m forkjax.fidelity` measures your agents")
    p.add_argument("--residual-fanout", action=argparse.BooleanOptionalAction, default=None,
                   help="forkkv (on by default there): every request also writes the residual KV of "
                        "the adapters in device slots, so that a second agent reading a context "
                        "another computed is a full hit (a request's fanout_adapters overrides it)")
    p.add_argument("--max-fanout-adapters", type=int, default=None,
                   help="forkkv: adapters one request fans out to at most (residual rows a token "
                        "writes, compiled into the step; default max_loras - 2, at most 6)")
    p.add_argument("--residual-fraction", type=float, default=None,
                   help="share of --kv-cache-bytes for the residual pool, in (0, 1) (default: one "
                        "residual copy per base token per adapter that fits in a device slot)")
    p.add_argument("--residual-copies", type=int, default=None,
                   help="forkkv: room for this many residual copies of each cached base token, the "
                        "adapters that read one context at once (default: every adapter that fits a slot)")
    p.add_argument("--schedule-policy", default="lpm", choices=("lpm", "fifo"),
                   help="admission order: lpm serves cached prefixes first, with a bounded wait "
                        "(%(default)s)")
    p.add_argument("--session-ttl", type=float, default=None, metavar="SECONDS",
                   help="seconds a session (session_id) with no request keeps its KV pages: about "
                        "your longest tool call (default: the engine's, 30); a request with "
                        "session_end releases them at once")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-, chunking- and cache-invariant logits: one program per step kind "
                        "(slower: BENCHMARKS.md, deterministic mode)")
    p.add_argument("--kv-cache-bytes", type=size_flag, default=None,
                   help="KV cache budget: bytes, 60e9, 60GB, 56GiB, 60g (decimal) or 56G (binary) "
                        "(default: 90%% of free device memory less the largest "
                        "step's workspace; 256M on CPU)")
    p.add_argument("--host-kv-bytes", type=size_flag, default=None,
                   help="host memory for KV pages evicted from the device, loaded back on a hit "
                        "instead of recomputed, e.g. 64G; 0: off (default: off on a CPU, on a GPU "
                        "half the available host memory, at most twice the KV budget; raises XLA's "
                        "pinned host limit to fit)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="(%(default)s)")
    p.add_argument("--max-batch-size", type=int, default=None,
                   help="running requests at most (default: 256 on a GPU of 40 GiB or more, 128 from 16 "
                        "GiB, else 64; 16 on CPU)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--max-prefill-tokens", type=int, default=2048,
                   help="prompt tokens per prefill step (%(default)s)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (%(default)s)")
    p.add_argument("--max-loras", type=int, default=8,
                   help="adapter slots on the device, the base model's included (%(default)s); more "
                        "adapters wait on the host and take a slot when a request needs one")
    p.add_argument("--lora-path", choices=("fused", "sgmv"), default="fused",
                   help="fused: A as rows of each projection's GEMM (every token through every slot); "
                        "sgmv: each token against its own adapter slot, a cost that follows the "
                        "adapters in the batch (%(default)s)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="devices the model and the base KV cache are split over, by attention "
                        "heads (%(default)s; no host KV tier then)")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters loaded at most, on the host (default: no bound)")
    p.add_argument("--pinned-lora", action="append", default=[], metavar="NAME",
                   help="a --lora adapter that keeps its device slot (repeatable)")
    p.add_argument("--max-lora-rank", type=int, default=None,
                   help="largest adapter rank (default: the initial adapters' largest, at least 16)")
    p.add_argument("--lora-target-modules", nargs="+", default=None, metavar="MODULE",
                   help="projections with LoRA slots, e.g. q_proj k_proj v_proj o_proj (default: "
                        "those the --lora adapters target; all when none are given)")
    p.add_argument("--warmup", default="background", choices=WARMUP,
                   help="when the step programs compile (%(default)s)")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="wait for each step before scheduling the next (default: overlap them)")
    p.add_argument("--seed", type=int, default=0, help="weights seed of the built-in models (%(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="%(default)s (loopback); 0.0.0.0 exposes the server")
    p.add_argument("--port", type=int, default=8000,
                   help="%(default)s; 0 picks a free port (printed when ready)")
    p.add_argument("--api-key", default=os.environ.get("FORKJAX_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route under "
                        f"{', '.join(GUARDED_PREFIXES)} (/health, /metrics, /version and the API "
                        "docs stay open; default: $FORKJAX_API_KEY)")
    p.add_argument("--max-request-bytes", type=size_flag, default=DEFAULT_MAX_BODY,
                   help="largest request body accepted (8M)")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request body may take to arrive, else 408 (%(default)s)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM or SIGINT, seconds running requests get to finish before the "
                        "rest are aborted, each answered with a 503 error (a stream: an error "
                        "event) (%(default)s)")
    p.add_argument("--compilation-cache-dir", default=os.path.expanduser("~/.cache/forkjax/jax"),
                   help="XLA programs kept across restarts (%(default)s; '' disables; "
                        "$JAX_COMPILATION_CACHE_DIR wins)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="(%(default)s)")
    return p


def _positive(v) -> bool:
    return v >= 1


# flag -> (whether a value is valid, what it must be); NaN fails every test.
NUMBER_FLAGS = {
    "port": (lambda v: 0 <= v <= 65535, "a TCP port, 0 to 65535 (0 picks a free one)"),
    "max_model_len": (_positive, "a context length >= 1 token"),
    "max_batch_size": (_positive, "an int >= 1"),
    "max_prefill_tokens": (_positive, "an int >= 1"),
    "page_size": (_positive, "an int >= 1"),
    "max_loras": (_positive, "an int >= 1 (the base model takes one slot)"),
    "max_lora_rank": (_positive, "an int >= 1"),
    "max_cpu_loras": (_positive, "an int >= 1"),
    "tensor_parallel_size": (_positive, "a number of devices >= 1"),
    "kv_cache_bytes": (_positive, "a size > 0"),
    "max_request_bytes": (_positive, "a size > 0"),
    "seed": (lambda v: 0 <= v < 2**63, "an int in [0, 2**63)"),
    "residual_fraction": (lambda v: 0 < v < 1, "a fraction strictly between 0 and 1"),
    "residual_copies": (_positive, "an int >= 1"),
    "max_fanout_adapters": (lambda v: v >= 0, "an int >= 0"),
    "session_ttl": (lambda v: 0 <= v < math.inf, "finite seconds >= 0"),
    "body_timeout": (lambda v: 0 < v < math.inf, "finite seconds > 0"),
    "shutdown_timeout": (lambda v: 0 <= v < math.inf, "finite seconds >= 0"),
}


def check_numbers(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """Refuse out-of-range numeric flags before anything loads, naming the flag: otherwise a
    bad value fails later, deep in the engine, or is silently replaced (--port 99999)."""
    for name, (valid, what) in NUMBER_FLAGS.items():
        value = getattr(args, name)
        if value is not None and not valid(value):
            parser.error(f"--{name.replace('_', '-')} {value}: expected {what}")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The flags as `Engine.from_pretrained`'s keywords (those left at None keep the engine's
    defaults); the engine core process builds its engine with them."""
    kw = dict(adapters=dict(args.lora) or None, cache_policy=args.cache_policy, dtype=args.dtype,
              page_size=args.page_size, kv_cache_bytes=args.kv_cache_bytes,
              max_batch_size=args.max_batch_size, max_lora_rank=args.max_lora_rank,
              max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras,
              pinned_adapters=args.pinned_lora, seed=args.seed,
              lora_target_modules=args.lora_target_modules, lora_path=args.lora_path,
              max_model_len=args.max_model_len, max_prefill_tokens=args.max_prefill_tokens,
              residual_fanout=args.residual_fanout, max_fanout_adapters=args.max_fanout_adapters,
              residual_fraction=args.residual_fraction, residual_copies=args.residual_copies,
              schedule_policy=args.schedule_policy, deterministic=args.deterministic,
              host_kv_bytes=args.host_kv_bytes, tensor_parallel_size=args.tensor_parallel_size,
              warmup=args.warmup, progress=True, overlap=not args.disable_overlap_schedule)
    if args.session_ttl is not None:
        kw["session_ttl_s"] = args.session_ttl
    return kw


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (exit status 2 and one line naming the flag if not)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.residual_fanout and args.cache_policy != "forkkv":
        parser.error(f"--residual-fanout needs --cache-policy forkkv, not {args.cache_policy}")
    check_numbers(parser, args)
    return args


def main(argv: list[str] | None = None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s:     %(name)s: %(message)s")
    logging.getLogger("forkjax").setLevel(args.log_level.upper())
    try:
        client = CoreClient.spawn(args.model, engine_kwargs(args), log_level=args.log_level,
                                  compilation_cache_dir=args.compilation_cache_dir)
    except (ValueError, CoreDied) as e:  # bad flags or files: say which, no traceback
        sys.exit(f"forkjax.serve: error: {e}")
    try:
        serve(args, client)
    finally:
        client.shutdown()  # aborts what the drain left running; stops the engine core
    if client.dead is not None:
        sys.exit(f"forkjax: stopped: {client.dead}")
    print("forkjax: stopped", file=sys.stderr, flush=True)


def serve(args: argparse.Namespace, client: CoreClient):
    """Run the HTTP front end until SIGTERM or SIGINT, or until the engine core dies."""
    name = args.served_model_name or display_path(args.model)
    app = create_app(client, model_name=name, model_root=display_path(args.model), api_key=args.api_key,
                     max_body_bytes=args.max_request_bytes, body_timeout_s=args.body_timeout)
    if args.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"forkjax: warning: serving on {args.host} without --api-key: anyone who can reach it "
              "can use it and load adapters from this machine's files", file=sys.stderr)

    def ready(url: str):
        print(f"forkjax: ready: serving {name} with adapters {sorted(client.adapters) or '(none)'} at "
              f"{url}/v1" + (" (API key required)" if args.api_key else ""), flush=True)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout + ABORT_GRACE_S)
    server = ReadyServer(config, ready, drain_s=args.shutdown_timeout, abort=client.stop_requests)

    def died():
        print(f"forkjax: {client.dead}: stopping in {DEATH_GRACE_S:g} s", file=sys.stderr, flush=True)
        asyncio.get_running_loop().call_later(DEATH_GRACE_S, setattr, server, "should_exit", True)
    client.on_death = died
    server.run()


class ReadyServer(uvicorn.Server):
    """uvicorn that says once, with the bound port, when it accepts requests, and stops on
    SIGTERM as on SIGINT: it stops accepting, lets running requests finish for up to `drain_s`
    seconds, then calls `abort` (the engine loop ends the rest, and each is answered with an
    error rather than cut off), and returns (exit status 0) once they are answered. uvicorn
    cancels what is still unanswered at its `timeout_graceful_shutdown`."""

    def __init__(self, config: uvicorn.Config, ready, *, drain_s: float, abort):
        super().__init__(config)
        self._ready, self._drain_s, self._abort = ready, drain_s, abort

    def handle_exit(self, sig: int, frame) -> None:
        if not self.should_exit:
            print(f"forkjax: {signal.Signals(sig).name}: stopping; running requests get "
                  f"{self._drain_s:g} s to finish", file=sys.stderr, flush=True)
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None):
        timer = asyncio.get_running_loop().call_later(self._drain_s, self._drain_timed_out)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _drain_timed_out(self):
        if self.server_state.tasks:
            print(f"forkjax: shutdown: aborting {len(self.server_state.tasks)} request(s) still "
                  f"running after {self._drain_s:g} s (--shutdown-timeout)", file=sys.stderr,
                  flush=True)
        self._abort()

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's, without raising the signal again once stopped (that exits 143 on
        SIGTERM): a drained stop is a clean exit."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self._ready(f"http://{f'[{host}]' if ':' in host else host}:{port}")


if __name__ == "__main__":
    main()
