"""Constrained decoding: a request's llguidance matcher, advanced on each token it samples, and
the allowed-token bitmask of its next token, which the sampling program applies on the device
(runtime/sampler.py, `apply_token_bitmask`).

The grammar arrives as llguidance's serialized grammar (`SamplingParams.guided`, built by the
front end: server/structured.py); the matcher is built from the engine's tokenizer, the byte
tokenizer of the built-in models or a checkpoint's fast HF tokenizer (`llguidance.hf`).
"""

from __future__ import annotations

import functools
import weakref

import llguidance as llg
import llguidance.numpy as llg_np
import numpy as np

from forkjax.tokenizer import ByteTokenizer

_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class GuidedDecodingError(RuntimeError):
    """The matcher refused a sampled token (it cannot under its mask: a mask that left no
    token, e.g. with min_tokens banning the end of the grammar)."""


class _ByteTokens:
    """ByteTokenizer as llguidance's TokenizerWrapper expects it: every id's bytes, specials
    (BOS, EOS) as named tokens."""

    def __init__(self, tok: ByteTokenizer):
        self.eos_token_id, self.bos_token_id = tok.eos_token_id, tok.bos_token_id
        self.tokens = [bytes([i]) for i in range(256)] + [b"<s>", b"</s>"]
        self.special_token_ids = [tok.bos_token_id, tok.eos_token_id]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def ll_tokenizer(tokenizer, vocab_size: int) -> llg.LLTokenizer:
    """The llguidance tokenizer of an engine's tokenizer (built once each: ~1 s for a real
    vocabulary); `vocab_size` the model's (its logits' width, at least the tokenizer's)."""
    if tokenizer not in _TOKENIZERS:
        if isinstance(tokenizer, ByteTokenizer):
            ll = llg.LLTokenizer(llg.TokenizerWrapper(_ByteTokens(tokenizer)), n_vocab=vocab_size)
        else:
            from llguidance.hf import from_tokenizer
            ll = from_tokenizer(tokenizer.tok, n_vocab=vocab_size)
        _TOKENIZERS[tokenizer] = ll
    return _TOKENIZERS[tokenizer]


@functools.cache
def _executor() -> llg.LLExecutor:
    """llguidance's thread pool (80% of the host's cores, at most 32): a batch's masks are
    computed in parallel, outside the GIL."""
    return llg.LLExecutor()


def fill_masks(guides: list[tuple[Guide, int]], masks: np.ndarray) -> None:
    """Write the rows of masks ([B, W] int32, C-contiguous) of `guides` (guide, row; one row a
    guide) at once: a stopped matcher's row allows every token (its request has ended: that
    token is dropped)."""
    live = []
    for guide, i in guides:
        if guide.matcher.is_stopped():
            masks[i] = -1
        else:
            live.append((guide.matcher, i))
    if live:
        llg_np.fill_next_token_bitmask_par(_executor(), live, masks)


class Guide:
    """One request's matcher. Raises ValueError (naming what failed) if the grammar does not
    compile."""

    __slots__ = ("matcher",)

    def __init__(self, grammar: str, tokenizer: llg.LLTokenizer):
        self.matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)  # errors: its error state
        if self.matcher.is_error():
            raise ValueError(self.matcher.get_error())

    def advance(self, token: int) -> None:
        """Consume a sampled token (GuidedDecodingError if the grammar refuses it)."""
        if not self.matcher.consume_token(token):
            raise GuidedDecodingError(f"the grammar refused token {token}: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete and allows no more tokens."""
        return self.matcher.is_stopped()
