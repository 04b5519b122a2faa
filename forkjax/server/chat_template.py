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
"""

from __future__ import annotations

from forkjax.server.protocol import ChatMessage


def render_default(messages: list[ChatMessage], add_generation_prompt: bool) -> str:
    text = "".join(f"<|{m.role}|>\n{m.text}\n" for m in messages)
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


def chat_prompt_ids(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
    """Raises ValueError when the model has no tokenizer or its template rejects the messages."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: use /v1/completions with token ids")
    hf = getattr(tokenizer, "tok", None)
    if hf is not None and getattr(hf, "chat_template", None):
        try:
            text = hf.apply_chat_template([{"role": m.role, "content": m.text} for m in messages],
                                          tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # a template may raise on message orders it does not accept
            raise ValueError(f"the model's chat template rejected the messages: {e}") from None
        return tokenizer.encode(text, add_bos=False)  # the template writes its own BOS
    return tokenizer.encode(render_default(messages, add_generation_prompt))
