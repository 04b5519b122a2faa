"""Tool-call parsing and rendering, and the token bitmask, without a server: the Hermes parser
gives the same calls whether the text comes whole or a character at a time; the default
template renders tools and earlier calls; the device mask refuses exactly what llguidance's own
numpy reference refuses; scripts/bench_structured.py runs in an engine on tiny-llama."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from llguidance.numpy import apply_token_bitmask_inplace

from forkjax.runtime.sampler import apply_token_bitmask
from forkjax.server.chat_template import render_default
from forkjax.server.protocol import ChatMessage
from forkjax.server.tool_calls import ToolCallParser

HERMES = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
          '<tool_call>{"name": "calculate", "arguments": {"expr": "1+2"}}</tool_call>')


def _run(parser: ToolCallParser, pieces: list[str]):
    content, deltas = "", []
    for i, piece in enumerate(pieces):
        text, calls = parser.add(piece, final=i == len(pieces) - 1)
        content, deltas = content + text, deltas + calls
    return content, deltas


@pytest.mark.parametrize("step", [len(HERMES), 1, 7])
def test_hermes_calls_whole_or_streamed(step):
    pieces = [HERMES[i:i + step] for i in range(0, len(HERMES), step)]
    content, deltas = _run(ToolCallParser("auto"), pieces)
    assert content == "Let me check. "
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        (0, "get_weather", {"city": "Oslo"}), (1, "calculate", {"expr": "1+2"})]
    one = ToolCallParser("auto", parallel=False)
    assert [d.function.name for d in _run(one, pieces)[1]] == ["get_weather"]


def test_text_that_is_no_call_stays_content():
    for text in ("a < b <tool", "x <tool_call>not json</tool_call> y", "<tool_call>{\"name\": 3}"):
        content, deltas = _run(ToolCallParser("auto"), list(text))
        assert content == text and not deltas


REQUIRED = ('[{"name":"calc","parameters":{"expr":"{[\\"}]","n":[1,{"a":2}]}},'
            '{"name":"n\\u00e9w","parameters":{}}]')


@pytest.mark.parametrize("step", [len(REQUIRED), 1, 5])
def test_required_calls_stream_their_arguments(step):
    """`required`'s array: a call's name once complete, then its parameters as they come
    (braces and escaped quotes inside strings do not end them)."""
    parser = ToolCallParser("required")
    content, deltas = _run(parser, [REQUIRED[i:i + step] for i in range(0, len(REQUIRED), step)])
    expected = json.loads(REQUIRED)
    assert content == "" and [c.function.name for c in parser.calls] == [e["name"] for e in expected]
    assert [json.loads(c.function.arguments) for c in parser.calls] == [e["parameters"] for e in expected]
    for i, call in enumerate(parser.calls):  # the deltas reassemble to the calls
        mine = [d for d in deltas if d.index == i]
        assert mine[0].id == call.id and mine[0].function.name == call.function.name
        assert "".join(d.function.arguments for d in mine) == call.function.arguments
    cut = ToolCallParser("required")  # cut by max_tokens: the call so far
    _run(cut, [REQUIRED[:40]])
    assert [(c.function.name, c.function.arguments) for c in cut.calls] == [("calc", '{"expr":"{[')]


def test_default_template_renders_tools_and_earlier_calls():
    call = {"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{}"}}
    msgs = [ChatMessage(role="user", content="time?"),
            ChatMessage(role="assistant", content=None, tool_calls=[call]),
            ChatMessage(role="tool", content="12:00", tool_call_id="c1")]
    tools = [{"type": "function", "function": {"name": "now"}}]
    text = render_default(msgs, True, tools)
    assert text.startswith("<|system|>\nYou are a function calling AI model.")
    assert json.dumps(tools) in text
    assert ('<|assistant|>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n'
            '<|tool|>\n12:00\n<|assistant|>\n') in text


def test_bitmask_refuses_what_llguidance_refuses():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 70)).astype(np.float32)
    masks = rng.integers(-2**31, 2**31, (3, 3), dtype=np.int64).astype(np.int32)
    masks[2] = 0  # nothing allowed: the row keeps its logits
    expected = logits.copy()
    apply_token_bitmask_inplace(expected, masks)
    expected[2] = logits[2]
    np.testing.assert_array_equal(np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(masks))),
                                  expected)


def test_bench_structured_smoke(tmp_path):
    """scripts/bench_structured.py on tiny-llama: both step times, the masks' host time, and
    every bounded-schema output that stopped validates."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "bench_structured.py")
    spec = importlib.util.spec_from_file_location("bench_structured", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    r = bench.main(["--model", "tiny-llama", "--batches", "4", "--context", "64", "--steps", "4",
                    "--validity", "8", "--dtype", "float32", "--out", str(out)])
    assert json.loads(out.read_text())["batches"]["4"]["ratio"] == r["batches"][4]["ratio"] > 0
    assert r["batches"][4]["mask_s_per_step"] > 0
    assert r["validity"]["stop_fraction"] >= 0.75 and r["validity"]["valid_fraction_of_stopped"] == 1.0


def test_default_template_continues_the_final_message():
    msgs = [ChatMessage(role="user", content="Count"), ChatMessage(role="assistant", content="1, 2,")]
    assert render_default(msgs, False, continue_final=True) == "<|user|>\nCount\n<|assistant|>\n1, 2,"


def test_a_template_with_a_tools_slot_renders_them_and_earlier_calls(tmp_path):
    """A template that reads `tools` gets them, and an earlier call's arguments as an object."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from forkjax.server.chat_template import chat_prompt_ids
    from forkjax.tokenizer import load_tokenizer
    words = ["<s>", "</s>", "<unk>", "now", "calc", "user", "assistant", "tool", "1", "2", "3"]
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.chat_template = ("{% for t in tools %}{{ t['function']['name'] }} {% endfor %}"
                        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} "
                        "{% for c in m.get('tool_calls', []) %}{{ c['function']['name'] }} "
                        "{{ c['function']['arguments']['x'] }} {% endfor %}{% endfor %}")
    hf.save_pretrained(tmp_path)
    tools = [{"type": "function", "function": {"name": "now"}}, {"type": "function", "function": {"name": "calc"}}]
    msgs = [ChatMessage(role="user", content="1"),
            ChatMessage(role="assistant", content=None, tool_calls=[
                {"id": "c", "type": "function", "function": {"name": "calc", "arguments": '{"x": 2}'}}]),
            ChatMessage(role="tool", content="3", tool_call_id="c")]
    ids = chat_prompt_ids(load_tokenizer(str(tmp_path)), msgs, False, tools)
    assert [words[i] for i in ids] == ["now", "calc", "user", "1", "assistant", "calc", "2", "tool", "3"]
