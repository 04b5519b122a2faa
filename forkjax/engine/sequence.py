"""One request's state as the scheduler moves it: waiting -> prefilling -> decoding -> finished."""

from __future__ import annotations

import dataclasses
import enum
import itertools
import time
from collections.abc import Hashable

import numpy as np

from forkjax.cache.policy import Activated, unsalted
from forkjax.runtime.batch import PENDING
from forkjax.sampling_params import SamplingParams

_ids = itertools.count()


class NonFiniteError(RuntimeError):
    """A request's step computed a NaN or inf: the request ends with it and what it computed
    stays out of the cache (the rest of the batch is unaffected: slots never mix)."""


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(frozen=True, eq=False)
class Request:
    """What a client asked for; it never changes once queued."""
    prompt: tuple[int, ...]
    adapter: str | None  # None: the bare base model
    adapter_key: Hashable  # its adapter's cache identity (salted: cache/policy.py)
    params: SamplingParams
    score: bool = False  # compute prompt positions and keep their logits
    score_from: int = 0  # a score request computes from here, or where the cache ends
    return_hidden: bool = False  # a score request keeps its hidden states too
    # Deterministic mode: every prompt token, the last one included, is computed by an extend
    # step, even when the cache holds all but it (by default a decode step computes it then).
    prefill_whole_prompt: bool = False
    session_id: str | None = None  # a workflow's requests share one (sessions.py)
    session_end: bool = False  # its workflow's last: the session ends when it does
    session_tokens: int | None = None  # the workflow's expected final length
    session_next_s: float | None = None  # seconds from its end to the workflow's next request
    fanout: tuple[tuple[str, Hashable], ...] = ()  # (adapter name, key) whose residuals it writes


class Sequence:
    """A request and the state the scheduler moves it through. Only the scheduler (scheduler.py
    and the output processing it runs) writes the state; everything else reads it, the
    request's fields included (`seq.prompt` is `seq.req.prompt`)."""

    __slots__ = ("id", "req", "status", "output", "finish_reason", "error", "arrival", "priority",
                 "first_admitted", "cache", "reuse_cache", "fanout", "key_ns", "num_computed", "num_cached",
                 "num_verified", "pending", "sample_row", "prompt_logits", "prompt_hidden", "output_logprobs",
                 "params", "slot", "lora_start", "score", "session_id", "targets", "guide")

    def __init__(self, req: Request, guide=None):
        self.id = next(_ids)
        self.req = req
        # the request's fields read for every request of every step, as plain attributes (the
        # others go through __getattr__, a failed lookup first: ~1 µs each)
        self.params, self.score, self.session_id = req.params, req.score, req.session_id
        self.slot = 0  # its adapter's device slot, from when it starts (Scheduler._start)
        act = unsalted(req.adapter_key)  # Activated LoRA: its adapter acts from its invocation on
        self.lora_start = act.start if isinstance(act, Activated) else -1
        self.status = Status.WAITING
        self.output: list[int] = []
        self.finish_reason: str | None = None
        self.error: Exception | None = None
        self.arrival = time.monotonic()  # the scheduler's clock sets it when queued
        self.priority = self.arrival  # its workflow's age under pressure (admission.py)
        self.first_admitted: float | None = None  # when it was first admitted
        self.cache = None  # SeqCache while running
        self.reuse_cache = True  # False once it found no pages alone (Scheduler._preempt_one)
        self.targets = {key: name for name, key in req.fanout}  # fan-out residuals it still writes
        self.fanout: dict = {}  # {adapter slot: key} of those, from when it starts
        self.key_ns: list = []  # (pool, namespace) of each pool it uses (inflight.pool_namespaces)
        self.num_computed = 0  # leading tokens whose K/V is in the cache for this request
        # prompt tokens whose K/V came from the cache (full hits, or base hits where the policy
        # reuses them) when it was first admitted, pages taken over from others meanwhile
        # included: OpenAI's `usage.prompt_tokens_details.cached_tokens`
        self.num_cached = 0
        # leading tokens computed by steps whose results were read and found finite: what a
        # finish may insert into the trees (with overlap a step still in flight is unchecked)
        self.num_verified = 0
        self.pending = 0  # sampled tokens still on the device (overlap: at most 2, briefly)
        self.sample_row = 0  # row of its token in the last launched step's sampled output
        self.prompt_logits: list[np.ndarray] = []  # score requests: [chunk, vocab] pieces
        self.prompt_hidden: list[np.ndarray] = []  # [L + 1, chunk, d] pieces
        # with params.logprobs: per output token (its logprob, top ids [k], their logprobs [k])
        self.output_logprobs: list[tuple[float, np.ndarray, np.ndarray]] = []
        # with params.guided: its matcher (engine/guided.Guide), advanced on each output token
        self.guide = guide

    def __getattr__(self, name):
        return getattr(self.req, name)  # the request's fields, read-only

    @property
    def tokens(self) -> list[int]:
        """Known tokens (pending ones excluded)."""
        return [*self.req.prompt, *self.output]

    def token_at(self, i: int) -> int:
        """tokens[i] without building the list (a decode step needs one token); PENDING past
        the known tokens."""
        n, m = len(self.req.prompt), len(self.output)
        return self.req.prompt[i] if i < n else self.output[i - n] if i < n + m else PENDING

    def __len__(self) -> int:
        """Tokens so far, pending ones included (positions the cache has or will have)."""
        return len(self.req.prompt) + len(self.output) + self.pending

    @property
    def in_prefill(self) -> bool:
        """Tokens are still missing from the cache before the next decode step."""
        req = self.req
        return (self.num_computed < len(self) - 1 or (req.score and self.num_computed < len(self))
                or (req.prefill_whole_prompt and self.num_computed < len(req.prompt)))

    def finish(self, reason: str, error: Exception | None = None):
        self.status = Status.FINISHED
        self.pending = 0  # a token sampled after the end is dropped
        self.finish_reason = reason
        self.error = error
