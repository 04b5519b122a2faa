"""Logprobs in OpenAI's shapes: the completions endpoint's legacy object (the prompt's too, with
echo), vLLM's `prompt_logprobs`, and the chat endpoint's per-token list.

The engine gives, per token, (its logprob, the ids of the most likely tokens, their logprobs)
under the model's own distribution, before penalties, bias and temperature, as vLLM returns
them by default. A token's text is its own decoding (`token_id:N` without a tokenizer, as vLLM
writes token ids). The legacy object maps text to logprob, so alternatives that decode to one
text (bytes of an unfinished character) keep the most likely one's.
"""

from __future__ import annotations

import numpy as np

from forkjax.server.responses import (ChatLogprobs, ChatTokenLogprob, CompletionLogprobs,
                                      PromptLogprob, TopLogprob)


def token_text(tokenizer, token: int) -> str:
    return f"token_id:{token}" if tokenizer is None else tokenizer.decode([token])


def completion_logprobs(tokenizer, ids: list[int], entries: list, offset: int = 0) -> CompletionLogprobs:
    """`ids` and their engine logprob entries -> the legacy object; `offset`: where the first
    token's text starts in the choice's text (a stream's earlier chunks)."""
    out = CompletionLogprobs()
    for token, (lp, top_ids, top_lps) in zip(ids, entries):
        text = token_text(tokenizer, token)
        out.tokens.append(text)
        out.token_logprobs.append(lp)
        out.text_offset.append(offset)
        top: dict[str, float] = {}
        for t, x in zip(top_ids, top_lps):  # most likely first: tokens of one text keep its best
            top.setdefault(token_text(tokenizer, int(t)), float(x))
        out.top_logprobs.append(top)
        offset += len(text)
    return out


def chat_logprobs(tokenizer, ids: list[int], entries: list) -> ChatLogprobs:
    """`ids` and their engine logprob entries -> chat's `logprobs.content`."""
    def top(token, lp) -> TopLogprob:
        text = token_text(tokenizer, token)
        return TopLogprob(token=text, logprob=lp, bytes=list(text.encode("utf-8")))

    return ChatLogprobs(content=[
        ChatTokenLogprob(**top(token, lp).model_dump(),
                         top_logprobs=[top(int(t), float(x)) for t, x in zip(top_ids, top_lps)])
        for token, (lp, top_ids, top_lps) in zip(ids, entries)])


def score_entries(logits: np.ndarray, prompt: list[int], k: int) -> list:
    """logits [n, V] float32 of every prompt position (Engine.score) -> per prompt token after
    the first, (its logprob, the k most likely ids, their logprobs, its rank), as the engine
    gives generated tokens' (rank 1: the most likely)."""
    x = logits[:-1].astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    lp = x - np.log(np.exp(x).sum(-1, keepdims=True))  # [n - 1, V]
    chosen = lp[np.arange(len(prompt) - 1), prompt[1:]]
    top = np.argsort(-lp, axis=-1)[:, :k]
    ranks = (lp > chosen[:, None]).sum(-1) + 1
    return [(float(chosen[i]), top[i], np.take_along_axis(lp[i], top[i], 0), int(ranks[i]))
            for i in range(len(prompt) - 1)]


def vllm_prompt_logprobs(tokenizer, prompt: list[int], entries: list) -> list:
    """vLLM's `prompt_logprobs`: per prompt token {token id: {logprob, rank, decoded_token}} for
    it and its alternatives; the first token has none (null)."""
    out: list = [None]
    for token, (lp, top_ids, top_lps, rank) in zip(prompt[1:], entries):
        d = {str(token): PromptLogprob(logprob=lp, rank=rank, decoded_token=token_text(tokenizer, token))}
        for r, (t, x) in enumerate(zip(top_ids, top_lps), 1):
            d.setdefault(str(int(t)), PromptLogprob(logprob=float(x), rank=r,
                                                    decoded_token=token_text(tokenizer, int(t))))
        out.append(d)
    return out


def echoed(tokenizer, prompt: list[int], entries: list, generated: CompletionLogprobs | None) -> CompletionLogprobs:
    """The legacy object of an echoed prompt (its first token without a logprob) followed by
    the generated tokens' `generated`, their offsets moved past the prompt's text."""
    head = completion_logprobs(tokenizer, prompt[1:], [e[:3] for e in entries],
                               len(token_text(tokenizer, prompt[0])))
    first = token_text(tokenizer, prompt[0])
    out = CompletionLogprobs(text_offset=[0] + head.text_offset, token_logprobs=[None] + head.token_logprobs,
                             tokens=[first] + head.tokens, top_logprobs=[None] + head.top_logprobs)
    if generated is not None:
        shift = out.text_offset[-1] + len(out.tokens[-1])
        out.text_offset += [o + shift for o in generated.text_offset]
        out.token_logprobs += generated.token_logprobs
        out.tokens += generated.tokens
        out.top_logprobs += generated.top_logprobs
    return out
