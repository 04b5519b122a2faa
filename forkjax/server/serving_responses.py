"""/v1/responses (OpenAI's Responses API) over the chat machinery: a request becomes a chat
completion request and runs as one (serving_chat.py: its chat template, output constraints and
tool calls apply unchanged); its answer is shaped as a response's output items, whole or as the
Responses stream's events (responses_output.py).

  Responses                          chat completion
  instructions                       a system message first
  previous_response_id               that response's input and output items, before the input
  input: message items               messages (their text parts joined)
  function_call items                an assistant message's tool_calls (one message for a run)
  function_call_output items         tool messages
  tools, tool_choice                 the same functions and choice
  text.format                        response_format
  max_output_tokens                  max_completion_tokens

Stored responses (`store`, on by default) are kept in memory for `previous_response_id`, as
items: those of the responses they continue, their input, their output. Past a bound on their
number and size the least recently used go first, and then their ids answer as OpenAI answers
an id it does not have (400 previous_response_not_found).
"""

from __future__ import annotations

import collections
import logging
import time

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from forkjax.server.protocol import APIError, ChatCompletionRequest
from forkjax.server.protocol_responses import (FunctionCallItem, FunctionCallOutputItem, FunctionChoice,
                                               MessageItem, ResponsesRequest, TextConfig, TextFormat)
from forkjax.server.responses_output import (IncompleteDetails, OutputBuilder, ResponseObject, ResponseUsage,
                                             item_id, sse_event)
from forkjax.server.serving_chat import OpenAIServingChat
from forkjax.server.streaming import gather, unless_disconnected
from forkjax.server.validation import describe_errors

log = logging.getLogger("forkjax.serve")

# A chat request's fields -> the Responses fields they come from, for the errors they cause.
PARAMS = {"messages": "input", "response_format": "text", "max_completion_tokens": "max_output_tokens",
          "max_tokens": "max_output_tokens"}
MAX_STORED, MAX_STORED_CHARS = 1024, 64 << 20


class ResponseStore:
    """Stored responses' conversations (the items of the responses they continue, their input and
    output items) by id, bounded: at most `max_responses`, and their items' JSON at most `max_chars` characters
    in all (a response counts its whole chain: the items it keeps alive), the least recently
    used dropped first."""

    def __init__(self, max_responses: int = MAX_STORED, max_chars: int = MAX_STORED_CHARS):
        self.max_responses, self.max_chars = max_responses, max_chars
        self.entries: collections.OrderedDict[str, tuple[list, int]] = collections.OrderedDict()
        self.chars = 0

    def get(self, rid: str) -> tuple[list, int] | None:
        """(the items, their size) of response `rid`, or None when it is not stored."""
        entry = self.entries.get(rid)
        if entry is not None:
            self.entries.move_to_end(rid)
        return entry

    def put(self, rid: str, items: list, chars: int):
        self.entries[rid] = (items, chars)
        self.chars += chars
        while self.entries and (len(self.entries) > self.max_responses or self.chars > self.max_chars):
            self.chars -= self.entries.popitem(last=False)[1][1]


def _size(items) -> int:
    return sum(len(i.model_dump_json()) for i in items)


def chat_messages(instructions: str | None, items: list) -> list[dict]:
    """Instructions and items -> chat messages: a function call joins the assistant message
    before it (a turn that wrote and called, or called several functions, is one message)."""
    out = [{"role": "system", "content": instructions}] if instructions is not None else []
    for item in items:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": None})
            out[-1].setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "content": item.text, "tool_call_id": item.call_id})
    return out


def chat_request(req: ResponsesRequest, items: list) -> ChatCompletionRequest:
    """The chat completion request that generates `req`'s answer to `items`."""
    fmt = req.text.format if req.text is not None else None
    response_format = None if fmt is None or fmt.type == "text" else {"type": fmt.type}
    if fmt is not None and fmt.type == "json_schema":
        response_format["json_schema"] = {"name": fmt.name, "description": fmt.description,
                                          "schema": fmt.schema_, "strict": fmt.strict}
    choice = req.tool_choice
    if isinstance(choice, FunctionChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    tools = [{"type": "function", "function": t.model_dump(exclude={"type"})} for t in req.tools or ()]
    body = dict(
        model=req.model, messages=chat_messages(req.instructions, items), response_format=response_format,
        tools=tools or None, tool_choice=choice, parallel_tool_calls=req.parallel_tool_calls,
        max_completion_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
        seed=req.seed, top_k=req.top_k, repetition_penalty=req.repetition_penalty, user=req.user,
        session_id=req.session_id, session_end=req.session_end, session_tokens=req.session_tokens,
        session_next_s=req.session_next_s, cache_salt=req.cache_salt, fanout_adapters=req.fanout_adapters)
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        message, param = describe_errors(e.errors(), None)
        raise APIError(400, message, param=PARAMS.get(param, param)) from None


def new_response(req: ResponsesRequest, model: str) -> ResponseObject:
    """The response to `req`, in progress: its settings echoed, no output yet."""
    text = req.text if req.text is not None and req.text.format is not None else TextConfig(
        format=TextFormat(type="text"))
    return ResponseObject(
        id=item_id("resp"), created_at=int(time.time()), status="in_progress", model=req.model or model,
        instructions=req.instructions, max_output_tokens=req.max_output_tokens,
        parallel_tool_calls=req.parallel_tool_calls is not False, previous_response_id=req.previous_response_id,
        store=req.store is not False, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, text=text, tool_choice=req.tool_choice or "auto",
        tools=req.tools or [], user=req.user, safety_identifier=req.safety_identifier,
        metadata=req.metadata or {})


def _as_input(item):
    """An output item as the input item that sends it back."""
    data = item.model_dump(mode="json")
    return (MessageItem if data["type"] == "message" else FunctionCallItem).model_validate(data)


class OpenAIServingResponses:
    """/v1/responses: each request through `chat` (OpenAIServingChat.start_chat), its answer kept
    in `store` for the requests that continue it."""

    def __init__(self, chat: OpenAIServingChat, store: ResponseStore | None = None):
        self.chat = chat
        self.store = store if store is not None else ResponseStore()

    async def create_response(self, req: ResponsesRequest, raw: Request) -> Response | ResponseObject:
        history, history_chars = [], 0
        if req.previous_response_id is not None:
            stored = self.store.get(req.previous_response_id)
            if stored is None:
                raise APIError(400, f"Previous response with id '{req.previous_response_id}' not found.",
                               param="previous_response_id", code="previous_response_not_found")
            history, history_chars = stored
        items = history + req.input
        try:
            gen, prompt, new_parser = await self.chat.start_chat(chat_request(req, items))
        except APIError as e:
            e.param = PARAMS.get(e.param, e.param)
            raise
        response = new_response(req, self.chat.model_name)
        parser, out = new_parser(), OutputBuilder()

        def read(text: str, final: bool) -> list[dict]:
            content, deltas = (text, None) if parser is None else parser.add(text, final=final)
            return out.add(content, deltas)

        def finish(tokens: int, reason: str | None) -> list[dict]:
            """The answer ended (`reason`: its finish reason): close its items, count its usage and
            store it."""
            cut = reason == "length"
            events = out.finish(cut)
            response.status = "incomplete" if cut else "completed"
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens") if cut else None
            response.output = out.items
            response.usage = ResponseUsage.of(len(prompt), tokens, gen.cached_tokens(1))
            if req.store is not False:
                output = [_as_input(i) for i in out.items]
                self.store.put(response.id, items + output, history_chars + _size(req.input + output))
            return events

        if req.stream:
            events = self._events(response, gen, read, finish)
            return StreamingResponse(events, media_type="text/event-stream")

        async def collect():
            done = (await gather(gen))[0]
            read(done.text, True)
            finish(len(done.token_ids), done.finish_reason)
            return response
        return await unless_disconnected(raw, collect(), gen)

    async def _events(self, response: ResponseObject, gen, read, finish):
        """The Responses stream: created, in_progress, the output items' events as the text
        comes, then completed (or incomplete); an error once the stream began is an `error`
        event, as OpenAI sends it."""
        seq = 0

        def frame(event: dict) -> str:
            nonlocal seq
            seq += 1
            return sse_event(event, seq - 1)

        def state(kind: str) -> dict:
            return {"type": f"response.{kind}", "response": response.model_dump(mode="json", by_alias=True)}

        try:
            yield frame(state("created"))
            yield frame(state("in_progress"))
            tokens, reason = 0, None
            async for e in gen.events():
                tokens += len(e.token_ids)
                reason = e.finish_reason or reason
                for event in read(e.text, e.finish_reason is not None):
                    yield frame(event)
            for event in finish(tokens, reason):
                yield frame(event)
            yield frame(state(response.status))
        except APIError as e:
            yield frame({"type": "error", "code": e.code, "message": e.message, "param": e.param})
        except Exception as e:  # a bug: the stream already said 200, so say it in the stream
            log.exception("stream failed")
            yield frame({"type": "error", "code": "server_error", "message": repr(e), "param": None})
        finally:
            gen.close()  # runs on disconnect too: the response closes this generator
