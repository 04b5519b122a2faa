"""Tool calls of a chat completion: the constraint of `tool_choice` and the calls read back from
the generated text, whole or as stream deltas.

  tool_choice  constraint                                 calls read from the output
  none         the final message's (structured.py)        none: the text is the content
  auto         none, or with a final message's            Hermes format (vLLM's hermes parser):
               constraint, either Hermes calls or a final <tool_call>{"name": ..., "arguments": {...}}</tool_call>
               message that follows it (one grammar)
  required     a JSON array of {"name", "parameters"}     every entry (vLLM's format)
               (one entry without parallel_tool_calls)
  a function   that function's parameters schema          the whole output is its arguments

A final message's constraint (`response_format` and the like) applies to the turn that answers
rather than calls, as OpenAI defines it: with `required` or a named function the turn calls, so
it waits for a later turn. `ToolCallParser` reads the text as it streams: content passes through
until a call starts; a named function's or a `required` call's arguments stream as they come
(the latter's once its name is complete); a Hermes call is sent whole once its JSON is complete.
A non-streaming response runs the same parser over its whole text, so both agree (a call cut by
max_tokens keeps the arguments it got). Hermes text that does not parse as a call stays content.
"""

from __future__ import annotations

import json
import re
import uuid

from forkjax.server.protocol_tools import (DeltaFunctionCall, DeltaToolCall, FunctionCall,
                                           NamedToolChoice, ToolCall)
from forkjax.server.structured import checked, json_grammar
from forkjax.structured_output import with_grammars

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# A call of `required`'s array up to its parameters: the previous call's closing brace, if any,
# `[` or `,`, then its name
REQUIRED_HEAD = re.compile(r'\}?[\[,]\{"name":"((?:[^"\\]|\\.)*)","parameters":')
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def parameters(tool) -> dict:
    return tool.function.parameters if tool.function.parameters is not None else NO_PARAMETERS


def tool_constraint(req, final: str | None) -> str | None:
    """The grammar of a chat request's output, given `final`, the grammar of its final message's
    constraint (structured.request_grammar; None: none)."""
    choice = req.tool_choice
    if not req.tools or choice == "none":
        return final
    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in req.tools if t.function.name == choice.function.name)
        return json_grammar(parameters(tool), f"tools.{tool.function.name}.parameters")
    if choice == "required":
        calls = {"type": "array", "minItems": 1, "items": _calls_schema(req.tools, "parameters")}
        if req.parallel_tool_calls is False:
            calls["maxItems"] = 1
        return json_grammar(calls, "tools")
    if final is None:
        return None
    # auto: Hermes calls, as the chat template asks for them, or the final message
    call = json_grammar(_calls_schema(req.tools, "arguments"), "tools")
    more = ' ("\\n" call)*' if req.parallel_tool_calls is not False else ""
    return checked(with_grammars(f'start: calls | @final\ncalls: call{more}\n'
                                 f'call: "{CALL_OPEN}\\n" @call "\\n{CALL_CLOSE}"\n',
                                 call=call, final=final), "tools")


def _calls_schema(tools, arguments: str) -> dict:
    """One call of any of `tools`: {"name": its name, `arguments`: its parameters}."""
    return {"anyOf": [
        {"type": "object", "properties": {"name": {"const": t.function.name}, arguments: parameters(t)},
         "required": ["name", arguments], "additionalProperties": False} for t in tools]}


def parser_for(req) -> ToolCallParser | None:
    """The parser of `req`'s output (None: no tools, or tool_choice none)."""
    if not req.tools or req.tool_choice == "none":
        return None
    choice = req.tool_choice
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    return ToolCallParser("required" if choice == "required" else "named" if named else "auto",
                          named, parallel=req.parallel_tool_calls is not False)


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _call(name, arguments) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a parsed call, or None if it is no call."""
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False)


class ToolCallParser:
    """One choice's text -> content and tool-call deltas (`add` per new text)."""

    def __init__(self, mode: str, name: str | None = None, parallel: bool = True):
        self.mode, self.name, self.parallel = mode, name, parallel
        self.buffer = ""
        self.in_call = False  # inside a call: Hermes' <tool_call>, or `required`'s parameters
        # `required`: the parameters' nesting depth, inside a JSON string, after a backslash in one
        self.depth, self.in_string, self.escaped = 0, False, False
        self.calls: list[ToolCall] = []  # every call sent so far, whole

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def _send(self, name: str, arguments: str) -> list[DeltaToolCall]:
        if self.calls and not self.parallel:
            return []  # parallel_tool_calls false: the first call only
        call = ToolCall(id=_call_id(), function=FunctionCall(name=name, arguments=arguments))
        self.calls.append(call)
        return [DeltaToolCall(index=len(self.calls) - 1, id=call.id, type="function",
                              function=DeltaFunctionCall(name=name, arguments=arguments))]

    def add(self, text: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        """New text (`final`: the last) -> (content to send, tool-call deltas to send)."""
        if self.mode == "named":
            if not self.calls:
                return "", self._send(self.name, text)
            return "", self._arguments(text)
        self.buffer += text
        if self.mode == "required":
            return "", self._required()
        return self._hermes(final)

    def _arguments(self, text: str) -> list[DeltaToolCall]:
        """More of the last call's arguments."""
        if not text:
            return []
        self.calls[-1].function.arguments += text
        return [DeltaToolCall(index=len(self.calls) - 1, function=DeltaFunctionCall(arguments=text))]

    def _required(self) -> list[DeltaToolCall]:
        """The constrained array `[{"name":"...","parameters":{...}},...]`, compact and in this
        key order (the grammar's): each call is sent once its name is complete, its parameters as
        they come."""
        deltas = []
        while True:
            if not self.in_call:  # between calls: wait for the next one's name
                m = REQUIRED_HEAD.match(self.buffer)
                if m is None or (self.calls and not self.parallel):
                    return deltas
                deltas += self._send(json.loads(f'"{m[1]}"'), "")
                self.buffer, self.in_call = self.buffer[m.end():], True
            n = _object_end(self)  # how much of the buffer the parameters take
            deltas += self._arguments(self.buffer[:n])
            self.buffer = self.buffer[n:]
            if self.in_call:  # the parameters go on in text still to come
                return deltas

    def _hermes(self, final: bool) -> tuple[str, list[DeltaToolCall]]:
        content, deltas = "", []
        while True:
            if not self.in_call:
                at = self.buffer.find(CALL_OPEN)
                if at < 0:
                    keep = 0 if final else _partial_suffix(self.buffer, CALL_OPEN)
                    cut = len(self.buffer) - keep
                    content, self.buffer = content + self.buffer[:cut], self.buffer[cut:]
                    return content, deltas
                content += self.buffer[:at]
                self.buffer, self.in_call = self.buffer[at + len(CALL_OPEN):], True
            at = self.buffer.find(CALL_CLOSE)
            if at < 0 and not final:
                return content, deltas
            body = self.buffer if at < 0 else self.buffer[:at]
            self.buffer = "" if at < 0 else self.buffer[at + len(CALL_CLOSE):]
            self.in_call = False
            try:
                parsed = json.loads(body)
                call = _call(parsed.get("name"), parsed.get("arguments", {})) if isinstance(parsed, dict) else None
            except ValueError:
                call = None
            if call is None:  # not a call after all: it stays text
                content += CALL_OPEN + body + ("" if at < 0 else CALL_CLOSE)
            else:
                deltas += self._send(*call)
            if at < 0:
                return content, deltas


def _object_end(p: ToolCallParser) -> int:
    """Characters of `p.buffer` that belong to the parameters object being read (all of them if
    it does not close in it), advancing p's depth and string state over them; p.in_call ends
    where the object closes."""
    for i, ch in enumerate(p.buffer):
        if p.in_string:
            p.escaped, p.in_string = (False, True) if p.escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            p.in_string = True
        elif ch in "{[":
            p.depth += 1
        elif ch in "}]":
            p.depth -= 1
            if p.depth == 0:
                p.in_call = False
                return i + 1
    return len(p.buffer)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back: a tag may follow)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
