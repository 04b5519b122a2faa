"""What a workflow is to a driver: LLM calls that become ready over time, and a sink for their
outputs. ReAct and MapReduce implement it; the in-process driver (`driver.py`) and the HTTP one
(`http_driver.py`) run any workflow the same way, so the workflow logic lives here only.

A driver loops: submit everything `pop_ready(now)` hands out, and when a call finishes, give its
tokens to `complete(request, output, now)`; when nothing runs, sleep until `next_ready_at()`.
Times are seconds since the run started; a workflow's first call is ready as soon as a driver's
slot starts it (loop.py). A workflow's shape (every length) is drawn when it is built, so
`final_tokens`, the tokens it holds at its end, is known before it runs, and the request that
ends it says so (`TurnRequest.last`): the drivers pass both to the engine's session.
"""

from __future__ import annotations

import abc
import dataclasses

import numpy as np

from forkjax.config import ModelConfig

# Random prompts stay in the id range of ordinary tokens of any tokenizer (Llama-2's whole vocab
# is 32000): ids above it are often reserved or special in larger vocabularies.
MAX_RANDOM_ID = 32_000


@dataclasses.dataclass(frozen=True, eq=False)
class TurnRequest:
    """One LLM call of a workflow."""
    session_id: str
    turn: int                         # index of this call among its workflow's calls
    adapter: str                      # the agent's LoRA adapter
    prompt: list[int]                 # [prompt_len] token ids
    max_tokens: int                   # tokens to generate (ignore_eos: exactly this many)
    fanout_adapters: tuple[str, ...]  # agents that read this prompt's prefix later
    last: bool = False                # the workflow's last call: it ends when this one finishes
    # the JSON schema its output must follow (ReAct's JSON tool calls), None: free; the call then
    # ends when its JSON does, or at max_tokens
    guided_json: dict | None = None


def invoked(cue: list[int], invocation) -> list[int]:
    """An agent's cue with its first tokens its Activated LoRA invocation (None: as it is): the
    adapter acts from there on, what precedes is the base model's, shared by every agent."""
    return cue if invocation is None else list(invocation) + cue[len(invocation):]


class Workflow(abc.ABC):
    session_id: str
    agents: tuple[str, ...]  # adapter names of its agents
    num_turns: int           # LLM calls in all
    turns_done: int
    tool_latency: float = 0.0  # seconds from a call's end to its next call (ReAct's tool calls)

    @property
    def done(self) -> bool:
        return self.turns_done == self.num_turns

    @property
    @abc.abstractmethod
    def final_tokens(self) -> int:
        """Prompt and generation tokens of the workflow's longest call (ReAct's and MapReduce's
        last): what it holds at its end, known from its shape before it runs."""

    @abc.abstractmethod
    def pop_ready(self, now: float) -> list[TurnRequest]:
        """The calls ready at `now` that were not handed out yet."""

    @abc.abstractmethod
    def complete(self, request: TurnRequest, output: list[int], now: float) -> None:
        """`request` finished at `now` with `output` ([max_tokens] generated ids)."""

    @abc.abstractmethod
    def next_ready_at(self) -> float | None:
        """When the next call becomes ready if none is running (a tool latency); None while one
        runs or when done."""


class TokenSampler:
    """Random token ids in [0, min(vocab, 32000)) without the model's bos/eos: a special token in
    the middle of a prompt would mark a false document boundary."""

    def __init__(self, vocab_size: int, special_ids):
        self.ids = np.setdiff1d(np.arange(min(vocab_size, MAX_RANDOM_ID)),
                                np.asarray(sorted(special_ids), dtype=np.int64))
        if not len(self.ids):
            raise ValueError(f"no ordinary token ids in a vocabulary of {vocab_size}")

    @classmethod
    def for_model(cls, cfg: ModelConfig) -> "TokenSampler":
        specials = set(cfg.eos_token_ids) | ({cfg.bos_token_id} if cfg.bos_token_id is not None else set())
        return cls(cfg.vocab_size, specials)

    def draw(self, rng: np.random.Generator, n: int) -> list[int]:
        return self.ids[rng.integers(0, len(self.ids), n)].tolist()
