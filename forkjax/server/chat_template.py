"""Chat messages -> prompt token ids.

A checkpoint whose tokenizer config has a `chat_template` is prompted with it (through
transformers, which renders it in a sandboxed Jinja environment). Otherwise, e.g. for the
byte-level built-in models, the default template below is used:

    <|system|>
    You are a planner.
    <|user|>
    Plan the task.
    <|assistant|>

one `<|role|>` line per message followed by its content, and a final `<|assistant|>` line when
`add_generation_prompt` is set (the default), after the tokenizer's BOS.

Tools (a chat request's `tools`) go to the template where it has a slot for them (it reads
`tools`, as Hermes, Qwen and Llama 3 templates do), with earlier assistant messages' tool calls
and the `tool` messages answering them. A template without that slot, the default one included,
gets them in the Hermes format instead: the tools in a system message that asks for
`<tool_call>{"name": ..., "arguments": ...}</tool_call>` (tool_calls.py parses it back), and
earlier calls written so in their assistant messages.
"""

from __future__ import annotations

import json

from forkjax.server.protocol import ChatMessage
from forkjax.server.tool_calls import CALL_CLOSE, CALL_OPEN

HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
    "Don't make assumptions about what values to plug into functions. Here are the available "
    "tools: <tools>{tools}</tools>\nFor each function call return a json object with function "
    "name and arguments within <tool_call></tool_call> XML tags as follows:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-dict>}}\n</tool_call>')


def _arguments(text: str):
    """A call's arguments as templates read them: the JSON object, or the text as sent."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _hermes_calls(m: ChatMessage) -> str:
    return "".join(f"{CALL_OPEN}\n" + json.dumps({"name": c.function.name, "arguments": _arguments(
        c.function.arguments)}, ensure_ascii=False) + f"\n{CALL_CLOSE}" for c in m.tool_calls or ())


def template_messages(messages: list[ChatMessage], tools: list[dict] | None, slot: bool) -> list[dict]:
    """Messages as template dicts; without a tools `slot`, tools and calls in the Hermes format."""
    out = []
    for m in messages:
        d = {"role": m.role, "content": m.text}
        if m.tool_calls and slot:
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
        elif m.tool_calls:
            d["content"] = "\n".join(x for x in (m.text, _hermes_calls(m)) if x)
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    if tools and not slot:
        system = HERMES_SYSTEM.format(tools=json.dumps(tools, ensure_ascii=False))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def render_default(messages: list[ChatMessage], add_generation_prompt: bool,
                   tools: list[dict] | None = None, continue_final: bool = False) -> str:
    """`continue_final`: the text ends where the last message's content does."""
    text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in template_messages(messages, tools, False))
    if continue_final:
        return text[:-1]
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


def chat_prompt_ids(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool,
                    tools: list[dict] | None = None, continue_final: bool = False) -> list[int]:
    """Raises ValueError when the model has no tokenizer or its template rejects the messages.
    `tools`: the request's tools as OpenAI sends them; `continue_final`: the prompt ends inside
    the last message (vLLM's continue_final_message)."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: use /v1/completions with token ids")
    hf = getattr(tokenizer, "tok", None)
    template = getattr(hf, "chat_template", None)
    if template:
        slot = isinstance(template, str) and "tools" in template
        try:
            text = hf.apply_chat_template(template_messages(messages, tools, slot), tools=tools if slot else None,
                                          tokenize=False, add_generation_prompt=add_generation_prompt,
                                          continue_final_message=continue_final)
        except Exception as e:  # a template may raise on message orders it does not accept
            raise ValueError(f"the model's chat template rejected the messages: {e}") from None
        return tokenizer.encode(text, add_bos=False)  # the template writes its own BOS
    return tokenizer.encode(render_default(messages, add_generation_prompt, tools, continue_final))
