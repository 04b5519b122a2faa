"""The server's parts without a server or a model: detokenizer, chat templates, request
validation, the command line (milliseconds, no JAX)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from forkjax.server.chat_template import chat_prompt_ids, render_default
from forkjax.server.detokenizer import IncrementalDetokenizer
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
    {"prompt": "x", "max_tokens": "5"}, {"prompt": "x", "max_tokens": True}, {"prompt": "x", "n": 1.5},
    {"prompt": "x", "temperature": float("nan")}, {"prompt": "x", "temperature": 3},
    {"prompt": ["a", 1]}, {"prompt": "x", "stop": [""] * 2}, {"prompt": "x", "logprobs": 21},
    {"prompt": "x", "best_of": 3}, {"prompt": "x", "presence_penalty": 2.5}, {"prompt": None},
    {"prompt": "x", "repetition_penalty": 0}, {"prompt": "x", "min_tokens": -1},
    {"prompt": "x", "logit_bias": {str(i): 1.0 for i in range(301)}},
    {"prompt": "x", "session_id": ""}, {"prompt": "x", "session_id": 5},
    {"prompt": "x", "session_id": "s" * 257}, {"prompt": "x", "cache_salt": ""},
    {"prompt": "x", "cache_salt": 3},
    {"prompt": "x", "fanout_adapters": "coder"}, {"prompt": "x", "fanout_adapters": [1]},
    {"prompt": "x", "fanout_adapters": ["coder"] * 257}])
def test_completion_request_rejects(body):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate(body)


def test_requests_accept_what_openai_clients_send():
    r = CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2], [3]], "temperature": 0,
                                          "stop": "\n", "logprobs": None, "echo": False, "unknown": 1,
                                          "session_id": "s" * 256, "fanout_adapters": []})
    assert r.stop_strings == ["\n"] and r.temperature == 0.0 and r.fanout_adapters == []
    r = CompletionRequest.model_validate({"prompt": "x", "max_tokens": 2.0, "n": 1.0, "temperature": 1})
    assert (r.max_tokens, r.n, r.temperature) == (2, 1, 1.0) and type(r.max_tokens) is int
    c = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                              "max_completion_tokens": 5, "tool_choice": "none",
                                              "response_format": {"type": "text"}})
    assert c.max_new_tokens == 5
    with pytest.raises(ValidationError, match="top_logprobs needs logprobs"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                              "top_logprobs": 2})


# ---- command line -----------------------------------------------------------------------------

def test_cli_lora_target_modules_reaches_the_engine():
    """A bad --lora-target-modules stops the server at start with the engine's message (the
    engine core process refuses it and the front end exits with it)."""
    from forkjax.serve import main
    with pytest.raises(SystemExit, match="lm_head.*not supported"):
        main(["--lora-target-modules", "q_proj", "lm_head", "--kv-cache-bytes", "32M",
              "--compilation-cache-dir", ""])


def test_cli_cache_flags_reach_the_engine():
    from forkjax.serve import engine_kwargs, parse_args
    keys = ("residual_fanout", "residual_fraction", "schedule_policy", "deterministic", "warmup")
    picked = [tuple(engine_kwargs(parse_args(argv)).get(k) for k in (*keys, "session_ttl_s"))
              for argv in ([], ["--residual-fanout", "--residual-fraction", "0.25", "--schedule-policy",
                                "fifo", "--deterministic", "--warmup", "full", "--session-ttl", "5"],
                           ["--warmup", "none", "--no-residual-fanout"])]
    assert picked == [(None, None, "lpm", False, "background", None),
                      (True, 0.25, "fifo", True, "full", 5.0), (False, None, "lpm", False, "none", None)]
    # unset: on under forkkv, where a second agent's full hit needs it, and off elsewhere
    from forkjax.config import EngineConfig
    assert [EngineConfig(cache_policy=p).residual_fanout for p in ("forkkv", "prefix")] == [True, False]


@pytest.mark.parametrize("argv, message", [
    (["--residual-fanout", "--cache-policy", "prefix"], "--residual-fanout needs --cache-policy forkkv"),
    (["--schedule-policy", "sjf"], "invalid choice: 'sjf'"),
    (["--residual-fraction", "half"], "invalid float value"),
    (["--session-ttl", "-1"], "--session-ttl -1.0: expected finite seconds >= 0"),
])
def test_cli_refuses_bad_cache_flags_before_loading(argv, message, capsys, monkeypatch):
    from forkjax.serve import CoreClient, main
    monkeypatch.setattr(CoreClient, "spawn", lambda *a, **kw: pytest.fail("started the engine"))
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
