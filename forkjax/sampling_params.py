"""How a request samples: `SamplingParams`, checked when built.

Plain Python with no dependency, so that the HTTP front end builds the parameters it sends the
engine-core process (server/messages.py) without importing the engine.
"""

from __future__ import annotations

import dataclasses
import functools

MAX_LOGPROBS = 20  # alternatives a generated token's logprobs may list (OpenAI's bound)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Logits processing (sampler.process_logits), in this order: logit_bias, then the stop tokens
    # masked while fewer than min_tokens are out, then the penalties, then temperature and
    # sampling. presence / frequency: OpenAI's, over the generated tokens; repetition: vLLM's
    # (a seen token's logit divided by it if positive, multiplied if not), over prompt and output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    # The model's own log-probabilities (before processing) of each generated token and of its
    # `logprobs` most likely alternatives; None: none returned.
    logprobs: int | None = None
    # Constrained decoding: an llguidance grammar (serialized; server/structured.py builds it)
    # that masks every sampled token after the processing above (engine/guided.py); None: off.
    guided: str | None = None

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) \
                or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r}: expected an int >= 0")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature={self.temperature!r}: expected a finite number >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r}: expected a number in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not 0 <= self.top_k < 2 ** 31:
            raise ValueError(f"top_k={self.top_k!r}: expected an int in [0, 2**31)")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed={self.seed!r}: expected an int")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not -2 <= v <= 2:
                raise ValueError(f"{name}={v!r}: expected a number in [-2, 2]")
        r = self.repetition_penalty
        if not isinstance(r, (int, float)) or isinstance(r, bool) or not 0 < r < float("inf"):
            raise ValueError(f"repetition_penalty={r!r}: expected a finite number > 0")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens={self.min_tokens!r}: expected an int in [0, max_new_tokens]")
        for entry in self.logit_bias:
            if (len(entry) != 2 or not _is_int(entry[0]) or entry[0] < 0
                    or not isinstance(entry[1], (int, float)) or not -100 <= entry[1] <= 100):
                raise ValueError(f"logit_bias entry {entry!r}: expected (token id >= 0, a bias in [-100, 100])")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs={self.logprobs!r}: expected an int in [0, {MAX_LOGPROBS}] or None")
        if self.guided is not None and not isinstance(self.guided, str):
            raise ValueError(f"guided={self.guided!r}: expected a grammar (str) or None")

    @functools.cached_property  # read for every request of every step
    def processed(self) -> bool:
        """Whether the logits are changed before sampling (penalties, bias, min_tokens)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.min_tokens or self.logit_bias)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
