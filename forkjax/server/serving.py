"""/v1/completions over the engine-core process, and what it shares with /v1/chat/completions
(serving_chat.py).

One HTTP request becomes prompts x n engine sequences (its choices), queued atomically: this
module checks the request against the model (adapter, context, fan-out), builds the choices'
sampling parameters and shapes the OpenAI response bodies; streaming.py carries the choices'
outputs to the client, whole or as server-sent events.
"""

from __future__ import annotations

import random
import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from forkjax.sampling_params import SamplingParams
from forkjax.server import messages as m
from forkjax.server.core_client import CoreClient, CoreError
from forkjax.server.logprobs import completion_logprobs, echoed, vllm_prompt_logprobs
from forkjax.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from forkjax.server.responses import CompletionChoice, CompletionResponse, UsageInfo
from forkjax.server.streaming import (ClientLeft, Generation, PromptOnly, client_left, gather, sse,
                                      unless_disconnected, until_disconnected)
from forkjax.server.structured import request_grammar
from forkjax.server.validation import MAX_CHOICES


def _listed(prompt) -> list:
    """The request's prompts as sent: one text or id list, or a batch of them."""
    return [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt


def _unknown_fanout(name: str) -> APIError:
    return APIError(404, f"fanout_adapters: the adapter `{name}` does not exist.",
                    param="fanout_adapters", code="model_not_found")


class OpenAIServing:
    def __init__(self, client: CoreClient, model_name: str, tokenizer):
        self.client, self.model_name, self.tokenizer = client, model_name, tokenizer
        info = client.info
        self.max_model_len, self.pool_tokens, self.vocab_size = (info.max_model_len, info.pool_tokens,
                                                                 info.vocab_size)

    # ---- shared ---------------------------------------------------------------------------

    def adapter_for(self, model: str | None) -> str | None:
        """`model` -> adapter name (None: the base model), or 404 as OpenAI answers."""
        if model is None or model == self.model_name:
            return None
        if model not in self.client.adapters:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return model

    def check_fanout(self, names: list[str] | None):
        """`fanout_adapters` before anything is queued: 400 off forkkv, 404 for a name that is
        no adapter (the base model has no residual to write)."""
        policy = self.client.info.cache_policy
        if names and policy != "forkkv":
            raise APIError(400, "fanout_adapters needs the forkkv cache policy; this server runs "
                                f"{policy!r} (--cache-policy)", param="fanout_adapters")
        for name in names or ():
            if name not in self.client.adapters:
                raise _unknown_fanout(name)

    def max_tokens(self, requested: int | None, prompt_len: int, param: str) -> int:
        """The completion budget: `requested`, or (None) all the context and the KV pool allow."""
        if requested is None:
            requested = min(self.max_model_len, self.pool_tokens) - prompt_len
            if requested >= 1:
                return requested
            requested = 1
        if prompt_len + requested > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. "
                                f"However, you requested {prompt_len + requested} tokens ({prompt_len} in "
                                f"the {param}, {requested} for the completion). Please reduce the length "
                                f"of the {param} or completion.", param=param, code="context_length_exceeded")
        return requested

    def sampling(self, req, max_tokens: int, sample: int, guided: str | None = None) -> SamplingParams:
        top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
        seed = random.getrandbits(32) if req.seed is None else req.seed + sample
        if isinstance(req, ChatCompletionRequest):
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
        else:
            logprobs = req.logprobs
        if req.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens={req.min_tokens} exceeds the {max_tokens} tokens the "
                                "completion may have", param="min_tokens")
        try:
            return SamplingParams(
                max_new_tokens=max_tokens,
                temperature=float(1.0 if req.temperature is None else req.temperature),
                top_p=float(1.0 if req.top_p is None else req.top_p),
                top_k=min(top_k, self.vocab_size), seed=seed & 0xFFFFFFFF,
                # an id outside the vocabulary is never sampled: it cannot stop anything
                stop_token_ids=tuple(t for t in req.stop_token_ids or () if 0 <= t < self.vocab_size),
                ignore_eos=req.ignore_eos,
                presence_penalty=float(req.presence_penalty or 0),
                frequency_penalty=float(req.frequency_penalty or 0),
                repetition_penalty=float(req.repetition_penalty or 1), min_tokens=req.min_tokens,
                logit_bias=self.logit_bias(req.logit_bias), logprobs=logprobs, guided=guided)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def logit_bias(self, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
        """OpenAI's {"token id": bias} -> ((id, bias), ...), or 400 naming the bad entry."""
        out = []
        for key, value in (bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                token = -1
            if not 0 <= token < self.vocab_size or not -100 <= value <= 100:
                raise APIError(400, f"logit_bias: {key!r}: {value!r}: expected a token id in [0, "
                                    f"{self.vocab_size}) and a bias in [-100, 100]", param="logit_bias")
            out.append((token, float(value)))
        return tuple(out)

    async def start(self, req, adapter: str | None, prompts: list[list[int]],
                    max_tokens: list[int], guided: str | None = None) -> Generation:
        """Queue the choices of `req` (`guided`: the grammar that constrains them)."""
        fanout = req.fanout_adapters
        self.check_fanout(fanout)
        if guided is not None and self.tokenizer is None:
            raise APIError(400, "constrained decoding needs the model's tokenizer; this model has none",
                           param="response_format")
        if guided is not None and req.min_tokens:  # it would mask the end the grammar may need
            raise APIError(400, "min_tokens cannot be combined with an output constraint",
                           param="min_tokens")
        choices = [m.Choice(ids, self.sampling(req, budget, j, guided))
                   for ids, budget in zip(prompts, max_tokens) for j in range(req.n)]
        try:
            rid, stream = await self.client.submit(
                choices, adapter=adapter, session_id=req.session_id, session_end=req.session_end,
                session_tokens=req.session_tokens, session_next_s=req.session_next_s,
                cache_salt=req.cache_salt, fanout_adapters=fanout)
        except CoreError as e:
            if e.kind == "not_found":  # unloaded between our checks and the engine's
                if not fanout or (adapter is not None and adapter not in self.client.adapters):
                    raise APIError(404, f"The model `{req.model}` does not exist.", param="model",
                                   code="model_not_found") from None
                gone = [n for n in fanout if n not in self.client.adapters]
                raise _unknown_fanout((gone or fanout)[0]) from None
            if e.kind == "invalid":  # the engine's argument names are the body's, but for the prompt
                param = e.param if e.param not in (None, "prompt", "guided") else (
                    "response_format" if e.param == "guided" else
                    "prompt" if isinstance(req, CompletionRequest) else "messages")
                raise APIError(400, str(e), param=param) from None
            raise
        return Generation(self.client, rid, stream, self.tokenizer, req.stop_strings,
                          req.include_stop_str_in_output)

    # ---- /v1/completions ------------------------------------------------------------------

    def completion_prompts(self, prompt, n: int) -> list[list[int]]:
        prompt = _listed(prompt)
        if not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        if len(prompt) * n > MAX_CHOICES:
            raise APIError(400, f"{len(prompt)} prompts x n={n} exceeds {MAX_CHOICES} choices per request",
                           param="n" if n > 1 else "prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise APIError(400, "this model has no tokenizer: send the prompt as token ids",
                                   param="prompt")
                try:
                    p = self.tokenizer.encode(p)
                except Exception as e:  # whatever the tokenizer refuses came with the request
                    raise APIError(400, f"cannot tokenize the prompt: {e}", param="prompt") from None
            if not p:
                raise APIError(400, "prompt is empty", param="prompt")
            bad = [t for t in p if not 0 <= t < self.vocab_size]
            if bad:  # before the ids travel to the engine (msgpack refuses ints beyond 64 bits)
                raise APIError(400, f"token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})",
                               param="prompt")
            out.append(list(p))
        return out

    async def score_prompts(self, req: CompletionRequest, adapter, prompts) -> list | None:
        """Per prompt, its tokens' logprob entries (logprobs.score_entries), when echo or
        prompt_logprobs asks for them: computed by the engine core through its cache."""
        k = req.scores_prompt
        if k is None:
            return None
        out = []
        for p in prompts:
            try:
                out.append(await self.client.call(m.Score, prompt=p, k=k, adapter=adapter,
                                                  cache_salt=req.cache_salt))
            except CoreError as e:
                if e.kind != "invalid":
                    raise
                raise APIError(400, str(e), param="prompt") from None
        return out

    async def create_completion(self, req: CompletionRequest, raw: Request) -> Response:
        adapter = self.adapter_for(req.model)
        prompts = self.completion_prompts(req.prompt, req.n)
        budgets = [self.max_tokens(req.max_tokens or 1, len(p), "prompt") for p in prompts]
        guided = request_grammar(req)  # refused before any work
        scores = None
        if req.scores_prompt is not None:
            try:  # scored chunk by chunk in the core: a client that leaves meanwhile stops it
                scores = await until_disconnected(raw, self.score_prompts(req, adapter, prompts))
            except ClientLeft:
                return client_left()
        gen = (await self.start(req, adapter, prompts, budgets, guided) if req.max_tokens != 0
               else PromptOnly(len(prompts) * req.n))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        echo = [self.echo_text(p, ids) for p, ids in zip(_listed(req.prompt), prompts)] if req.echo else None
        token_ids = req.return_token_ids or self.tokenizer is None
        usage = lambda n: UsageInfo.of(sum(map(len, prompts)), n, gen.cached_tokens(req.n))  # noqa: E731

        def response(choices, usage=None):
            return CompletionResponse(id=rid, created=created, model=req.model or self.model_name,
                                      choices=choices, usage=usage)

        def logprobs(e, offset=0):
            return (None if req.logprobs is None
                    else completion_logprobs(self.tokenizer, e.token_ids, e.logprobs, offset))

        def head(i: int) -> CompletionChoice:
            """Choice i's echo (with its logprobs) and vLLM's prompt_logprobs, no completion."""
            p = i // req.n
            lp = (echoed(self.tokenizer, prompts[p], scores[p], None)
                  if echo and req.logprobs is not None else None)
            return CompletionChoice(index=i, text=echo[p] if echo else "", logprobs=lp, prompt_logprobs=(
                vllm_prompt_logprobs(self.tokenizer, prompts[p], scores[p])
                if req.prompt_logprobs is not None else None))

        if req.stream:
            async def chunks():
                n, offsets = 0, [0] * gen.choices
                for i in range(gen.choices if echo or scores else 0):
                    first = head(i)
                    lp = first.logprobs
                    offsets[i] = lp.text_offset[-1] + len(lp.tokens[-1]) if lp else len(first.text)
                    yield response([first])
                async for e in gen.events():
                    n += len(e.token_ids)
                    if e.text or e.finish_reason or token_ids or (e.token_ids and req.logprobs is not None):
                        lp = logprobs(e, offsets[e.index])
                        if lp is not None and lp.tokens:
                            offsets[e.index] = lp.text_offset[-1] + len(lp.tokens[-1])
                        yield response([CompletionChoice(
                            index=e.index, text=e.text, finish_reason=e.finish_reason, logprobs=lp,
                            token_ids=e.token_ids if token_ids else None)])
                if req.stream_options and req.stream_options.include_usage:
                    yield response([], usage(n))
            return sse(chunks(), gen)

        async def collect():
            done = await gather(gen)
            choices = []
            for i, e in enumerate(done):
                c = head(i)
                lp = logprobs(e)
                if c.logprobs is not None:
                    lp = echoed(self.tokenizer, prompts[i // req.n], scores[i // req.n], lp)
                choices.append(c.model_copy(update=dict(
                    text=c.text + e.text, finish_reason=e.finish_reason, logprobs=lp,
                    token_ids=e.token_ids if token_ids else None,
                    prompt_token_ids=prompts[i // req.n] if req.return_token_ids else None)))
            return response(choices, usage(sum(len(e.token_ids) for e in done)))
        return await unless_disconnected(raw, collect(), gen)

    def echo_text(self, given, ids: list[int]) -> str:
        """The prompt as echoed: the text sent, or its token ids decoded."""
        if isinstance(given, str):
            return given
        return "" if self.tokenizer is None else self.tokenizer.decode(ids)
