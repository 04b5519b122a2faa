"""The server's parts without a server or a model: detokenizer, chat templates, request
validation, and the engine thread over a scripted engine (milliseconds, no JAX)."""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time

import pytest
from pydantic import ValidationError

from forkjax.engine.sequence import SamplingParams, Sequence, Status
from forkjax.server.chat_template import chat_prompt_ids, render_default
from forkjax.server.detokenizer import IncrementalDetokenizer
from forkjax.server.engine_loop import EngineLoop, RequestHandle
from forkjax.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from forkjax.tokenizer import ByteTokenizer


# ---- detokenizer ------------------------------------------------------------------------------

def feed(d: IncrementalDetokenizer, ids, step=1) -> list[str]:
    out = []
    for i in range(0, len(ids), step):
        out.append(d.add(ids[i:i + step], final=i + step >= len(ids)))
    return out


def test_detokenizer_never_splits_a_character():
    ids = list("naïve → ok".encode())
    parts = feed(IncrementalDetokenizer(ByteTokenizer(), []), ids)
    assert "".join(parts) == "naïve → ok"
    assert all("\ufffd" not in p for p in parts)


@pytest.mark.parametrize("step", [1, 2, 5])
def test_stop_string_cuts_and_is_never_shown(step):
    d = IncrementalDetokenizer(ByteTokenizer(), ["STOP", "zz"])
    parts = feed(d, list(b"abc STnot yet STOP more"), step)
    assert "".join(parts) == "abc STnot yet " and d.stopped
    assert not any("STOP" in "".join(parts[:k]) for k in range(len(parts) + 1))


def test_held_back_prefix_is_released_at_the_end():
    d = IncrementalDetokenizer(ByteTokenizer(), ["STOP"])
    assert "".join(feed(d, list(b"ends with ST"))) == "ends with ST" and not d.stopped


# ---- chat templates ---------------------------------------------------------------------------

def test_default_chat_template():
    msgs = [ChatMessage(role="system", content="Plan."),
            ChatMessage(role="user", content=[{"type": "text", "text": "Go"}, {"type": "text", "text": "!"}])]
    text = "<|system|>\nPlan.\n<|user|>\nGo!\n<|assistant|>\n"
    assert render_default(msgs, True) == text
    assert chat_prompt_ids(ByteTokenizer(), msgs, True) == [256, *text.encode()]
    with pytest.raises(ValueError, match="no tokenizer"):
        chat_prompt_ids(None, msgs, True)


def test_chat_template_from_the_tokenizer_config(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from forkjax.tokenizer import load_tokenizer
    words = ["<s>", "</s>", "<unk>", "hello", "world", "[", "]", "user", "assistant"]
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.chat_template = ("{{ bos_token }}{% for m in messages %}[ {{ m['role'] }} ] {{ m['content'] }} "
                        "{% endfor %}{% if add_generation_prompt %}[ assistant ]{% endif %}")
    hf.save_pretrained(tmp_path)
    ids = chat_prompt_ids(load_tokenizer(str(tmp_path)), [ChatMessage(role="user", content="hello world")], True)
    assert ids == [0, 5, 7, 6, 3, 4, 5, 8, 6]  # the template's own BOS, once


# ---- request validation -----------------------------------------------------------------------

@pytest.mark.parametrize("body", [
    {"prompt": "x", "max_tokens": "5"}, {"prompt": "x", "max_tokens": True}, {"prompt": "x", "n": 1.0},
    {"prompt": "x", "temperature": float("nan")}, {"prompt": "x", "temperature": 3},
    {"prompt": ["a", 1]}, {"prompt": "x", "stop": [""] * 2}, {"prompt": "x", "logprobs": 2},
    {"prompt": "x", "best_of": 3}, {"prompt": "x", "presence_penalty": 0.5}, {"prompt": None}])
def test_completion_request_rejects(body):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate(body)


def test_requests_accept_what_openai_clients_send():
    r = CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2], [3]], "temperature": 0,
                                          "stop": "\n", "logprobs": None, "echo": False, "unknown": 1})
    assert r.stop_strings == ["\n"] and r.temperature == 0.0
    c = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                              "max_completion_tokens": 5, "tool_choice": "none",
                                              "response_format": {"type": "text"}})
    assert c.max_new_tokens == 5


# ---- the engine thread over a scripted engine -------------------------------------------------

class ScriptedEngine:
    """Every step (2 ms) appends token 7 to each running request; `fail_next` makes one raise."""

    def __init__(self):
        self.waiting, self.running = collections.deque(), []
        self.adapters = {"a": object(), "b": object()}
        self.fail_next = False
        self.scheduler = self
        self.slots = self

    @property
    def has_work(self):
        return bool(self.waiting or self.running)

    @property
    def by_name(self):
        return {n: (i, type("A", (), {"source": n})) for i, n in enumerate(self.adapters)}

    def add_request(self, prompt, adapter, params):
        if adapter is not None and adapter not in self.adapters:
            raise KeyError(adapter)
        if not prompt:
            raise ValueError("empty prompt")
        seq = Sequence(prompt, adapter, 0, None, params)
        self.waiting.append(seq)
        return seq

    def step(self):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("device on fire")
        time.sleep(0.002)
        while self.waiting:
            seq = self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
        for seq in list(self.running):
            seq.output.append(7)
            if len(seq.output) >= seq.params.max_new_tokens:
                self.abort(seq, "length")

    def abort(self, seq, reason="abort"):
        for q in (self.waiting, self.running):
            if seq in q:
                q.remove(seq)
        seq.finish(reason)

    def unload_adapter(self, name):
        assert not any(s.adapter == name for s in self.running), "unloaded under a running request"
        del self.adapters[name]


class Collector:
    def __init__(self):
        self.outputs, self.done = [], threading.Event()

    def __call__(self, out):
        self.outputs.append(out)
        if out.finish_reason is not None:
            self.done.set()

    @property
    def tokens(self):
        return sum((o.token_ids for o in self.outputs), [])


def submit(loop, adapter, n, prompt=(1,)) -> tuple[Collector, concurrent.futures.Future, RequestHandle]:
    sink = Collector()
    handle = RequestHandle(0, list(prompt), adapter, SamplingParams(max_new_tokens=n), sink)
    return sink, loop.add([handle]), handle


@pytest.fixture
def loop():
    engine_loop = EngineLoop(ScriptedEngine())
    engine_loop.start()
    yield engine_loop
    engine_loop.shutdown()
    assert not engine_loop.alive


def test_tokens_stream_to_the_sink(loop):
    sink, fut, _ = submit(loop, "a", 5)
    fut.result(5)
    assert sink.done.wait(5)
    assert sink.tokens == [7] * 5 and sink.outputs[-1].finish_reason == "length"
    assert loop.generation_tokens == 5


def test_a_refused_request_queues_nothing(loop):
    good = RequestHandle(0, [1], None, SamplingParams(max_new_tokens=50), Collector())
    bad = RequestHandle(1, [], None, SamplingParams(max_new_tokens=5), Collector())
    with pytest.raises(ValueError):
        loop.add([good, bad]).result(5)
    assert loop.call(lambda: loop.engine.has_work).result(5) is False
    with pytest.raises(KeyError):
        submit(loop, "nope", 1)[1].result(5)


def test_unload_waits_for_running_and_holds_new_requests(loop):
    running, _, _ = submit(loop, "a", 200)
    other, _, _ = submit(loop, "b", 3)
    unloaded = loop.after_drain("a", lambda: loop.engine.unload_adapter("a"))
    _, late_fut, _ = submit(loop, "a", 1)  # arrives while "a" drains: held, then refused
    assert other.done.wait(5) and not running.done.is_set()  # others keep flowing meanwhile
    unloaded.result(10)
    assert running.tokens == [7] * 200 and running.outputs[-1].finish_reason == "length"
    with pytest.raises(KeyError):
        late_fut.result(5)
    assert "a" not in loop.adapters


def test_an_engine_failure_fails_its_requests_and_the_loop_goes_on(loop):
    loop.call(lambda: setattr(loop.engine, "fail_next", True)).result(5)
    failed, _, _ = submit(loop, "a", 3)
    assert failed.done.wait(5)
    assert failed.outputs[-1].finish_reason == "error" and "on fire" in str(failed.outputs[-1].error)
    after, _, _ = submit(loop, "b", 2)
    assert after.done.wait(5) and after.tokens == [7, 7]


def test_abort_finishes_the_request(loop):
    sink, fut, handle = submit(loop, None, 10**6)
    fut.result(5)
    loop.abort([handle])
    assert sink.done.wait(5) and sink.outputs[-1].finish_reason == "abort"


def test_cli_lora_target_modules_reaches_the_engine():
    """A bad --lora-target-modules stops the server at start with the engine's message."""
    from forkjax.serve import main
    with pytest.raises(SystemExit, match="lm_head.*not supported"):
        main(["--lora-target-modules", "q_proj", "lm_head", "--kv-cache-bytes", "32M"])
