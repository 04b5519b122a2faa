"""A server's background warm-up compiles every program its requests run: once it logs "warm-up
done", a workflow's fan-out turn, sampling at a temperature, a chat answer's logprobs, an echoed
prompt's logprobs and logits processing compile nothing (the model runner logs "compiling a new
shape after warm-up" for any program it compiles after the warm-up)."""

from __future__ import annotations

import time

from serve_utils import STARTUP_S, complete, serve

# forkkv with --no-residual-fanout: a request fans out only when it names its agents, so fan-out
# runs programs of their own. One request at a time, 16-token chunks and one page-table width:
# decode (1) and extend (1, 16), each also with fan-out inputs (width 6: max_loras 8 - 2), the
# extend's score step with and without them, and six sampling programs of one row.
ARGS = ["--dtype", "float32", "--cache-policy", "forkkv", "--no-residual-fanout", "--residual-fraction", "0.5",
        "--max-batch-size", "1", "--max-prefill-tokens", "16", "--max-model-len", "256",
        "--kv-cache-bytes", "1M", "--warmup", "background", "--host", "127.0.0.1", "--port", "0"]
PLAN = "warm-up: 6 step programs (2 plain, 4 fan-out and score), 6 sampling programs"
PROMPT = list(range(5, 45))  # 40 tokens: three prefill chunks
COMPUTED = "forkjax:prefill_tokens_computed_total"


def test_requests_after_the_background_warmup_compile_nothing(tmp_path_factory):
    run = serve(tmp_path_factory, ARGS)
    server = next(run)
    try:
        _warm_then_serve(server)
    except BaseException:
        run.close()  # kills the server
        raise
    next(run, None)  # a drained stop, exit status 0


def _warm_then_serve(server):
    deadline = time.time() + STARTUP_S
    while "warm-up done" not in server.log.read_text():
        assert time.time() < deadline, server.log.read_text()[-4000:]
        time.sleep(0.2)
    assert PLAN in server.log.read_text()
    with server.http() as http:
        # a workflow's turn (workflows/http_driver.py's body): its agents read this prefix later
        turn = complete(http, model="planner", prompt=PROMPT, max_tokens=4, ignore_eos=True,
                        return_token_ids=True, session_id="wf0", session_tokens=80,
                        fanout_adapters=["coder", "critic"])
        assert len(turn["choices"][0]["token_ids"]) == 4
        computed = server.metrics()[COMPUTED]
        complete(http, model="coder", prompt=PROMPT + [7], max_tokens=4, temperature=0.8, seed=1,
                 session_id="wf0", session_end=True)
        assert server.metrics()[COMPUTED] - computed < 16  # the turn wrote coder's residuals
        r = http.post("/v1/chat/completions", json={
            "model": "critic", "messages": [{"role": "user", "content": "Plan the next step."}],
            "max_tokens": 4, "ignore_eos": True, "logprobs": True, "top_logprobs": 3})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["logprobs"]["content"]) == 4
        echo = complete(http, model="tiny-llama", prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
        assert len(echo["choices"][0]["logprobs"]["token_logprobs"]) == len(PROMPT)
        complete(http, model="planner", prompt=PROMPT[:20], max_tokens=6, presence_penalty=0.5,
                 frequency_penalty=0.3, repetition_penalty=1.2, min_tokens=3)
        complete(http, model="coder", prompt=PROMPT[:20], max_tokens=6, logit_bias={"9": 3.0}, logprobs=1)
    log = server.log.read_text()
    assert "compiling a new shape after warm-up" not in log, log[-4000:]
