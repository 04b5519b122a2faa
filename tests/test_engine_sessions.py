"""Workflow sessions: whole-workflow admission, `session_end`, idle sessions' holds, the
starvation bound, and suspension when a projection proves wrong."""

import time

import numpy as np
import pytest

import forkjax
from conftest import SMALL
from forkjax.cache import DualRadixCache
from forkjax.config import ModelConfig
from forkjax.engine.inflight import pool_namespaces
from forkjax.engine.sequence import Request, SamplingParams, Sequence, Status
from forkjax.engine.sessions import PREFETCH_LEAD_S, STALE_AFTER_S, Session, Sessions
from forkjax.models.builtin import BUILTIN_CONFIGS, random_adapter

TINY = ModelConfig.from_hf(BUILTIN_CONFIGS["tiny-llama"])
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
ADAPTERS = {f"a{i}": random_adapter(f"a{i}", TINY, 8, 1.0, ATTN, seed=i) for i in range(3)}
PAGE_BYTES = 32768  # one base page of tiny-llama, float32


def _prompt(seed, n):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 256, n)]


def _engine(policy="prefix", adapters=ADAPTERS, **kw):
    return forkjax.Engine.from_pretrained("tiny-llama", adapters=adapters, dtype="float32",
                                          cache_policy=policy, **dict(SMALL, max_model_len=1024, **kw))


def _workflows(engine, names, turns=3, n=4, ctx=160, gen=8, obs=8, hint=None, sessions=True, pause=None):
    """Closed-loop multi-turn workflows, all started at once: turn t of workflow w appends its
    output and an observation to the workflow's history and goes to agent names[t % len];
    the last turn says session_end; `pause`: each request's session_next_s (the next one is
    sent at once all the same). -> (histories, distinct tokens)."""
    hist = [_prompt(100 + w, ctx) for w in range(n)]
    params = SamplingParams(max_new_tokens=gen, ignore_eos=True)
    done = [0] * n

    def submit(w):
        kw = dict(session_id=f"w{w}", session_end=done[w] == turns - 1,
                  session_tokens=hint, session_next_s=pause) if sessions else {}
        return engine.add_request(hist[w], names[done[w] % len(names)], params, **kw)

    live = {w: submit(w) for w in range(n)}
    while live:
        engine.step()
        for w, seq in list(live.items()):
            if seq.status is Status.FINISHED:
                assert seq.error is None
                done[w] += 1
                hist[w] = hist[w] + seq.output
                del live[w]
                if done[w] < turns:
                    hist[w] = hist[w] + _prompt(200 + 10 * w + done[w], obs)
                    live[w] = submit(w)
    engine.cache.check()
    return hist, sum(len(h) - gen for h in hist)


@pytest.mark.parametrize("schedule_policy", ["lpm", "fifo"])
def test_whole_workflows_compute_each_token_about_once(schedule_policy):
    # 4 workflows of ~200 tokens (13 pages) each under a pool of 28 base pages: about half fit.
    # (No request waits long enough to become urgent, however slow the machine.)
    engine = _engine(kv_cache_bytes=28 * PAGE_BYTES, max_wait_s=1e9,
                     schedule_policy=schedule_policy)
    _, distinct = _workflows(engine, ["a0"])
    s = engine.stats()
    assert s["prefill_tokens_computed"] <= 1.1 * distinct, (s["prefill_tokens_computed"], distinct)
    assert s["preemptions"] == 0 and s["workflows_suspended"] == 0
    assert s["workflows_running_peak"] == 2


def test_sessions_keep_three_agents_histories_where_sessionless_requests_recompute():
    """Three agents take turns under `prefix` (each keeps its own copy of the history): the pool
    holds about two of four workflows. Without sessions each turn evicts what another
    workflow's next turn needs; with them the admitted workflows keep their caches and the
    others start as they end."""
    kw = dict(kv_cache_bytes=80 * PAGE_BYTES, max_wait_s=1e9)
    runs = {}
    for sessions in (True, False):
        engine = _engine(**kw)
        _workflows(engine, ["a0", "a1", "a2"], turns=6, sessions=sessions)
        runs[sessions] = engine.stats()
    assert runs[False]["base_hit_rate"] == 0 and runs[True]["base_hit_rate"] > 0.4
    assert runs[True]["prefill_tokens_computed"] < 0.6 * runs[False]["prefill_tokens_computed"]


def test_session_end_drops_the_holds_when_the_request_finishes():
    engine = _engine()
    tree = engine.cache.base_tree
    engine.generate([_prompt(1, 100)], adapters="a0", max_new_tokens=2, session_id="s")
    assert "s" in engine.scheduler.sessions.by_id
    assert tree.evictable_size(held=False) < tree.evictable_size()  # held between turns
    engine.generate([_prompt(1, 100) + [5, 6]], adapters="a1", max_new_tokens=2,
                    session_id="s", session_end=True)
    assert engine.scheduler.sessions.by_id == {}
    assert tree.evictable_size(held=False) == tree.evictable_size() > 0  # cached, not held


def test_an_idle_sessions_holds_are_taken_before_a_live_workflows():
    engine = _engine(kv_cache_bytes=40 * PAGE_BYTES)
    old, young = _prompt(7, 200), _prompt(8, 200)
    engine.generate([old], adapters="a0", max_new_tokens=2, session_id="old")
    engine.generate([young], adapters="a0", max_new_tokens=2, session_id="young")
    time.sleep(STALE_AFTER_S)  # both idle for longer than a client's round trip: gone
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    nxt = engine.add_request(young + [9, 9], "a0", params, session_id="young")  # live again
    big = engine.add_request(_prompt(9, 300), "a0", params)  # needs the pages of one of them
    while engine.scheduler.has_work:
        engine.step()
    assert nxt.error is None and big.error is None
    key = engine.slots.key_of("a0")
    assert engine.cache.match_lengths(young, key)[0] == 192  # the live workflow kept its pages
    assert engine.cache.match_lengths(old, key)[0] < 192  # the idle (older) one gave way
    assert engine.stats()["workflows_suspended"] == 1


def test_a_session_between_two_turns_is_not_stale():
    """A session whose request ended is between two turns, not gone, until STALE_AFTER_S past
    the pause it announced (`session_next_s`) and past the longest recent wait between two
    requests of one session: its pages never go to a newcomer in the round trip before its next
    request (over HTTP a few steps)."""
    cache = DualRadixCache("prefix", 16, base_pages=32, res_pages=0, base_page_bytes=1024)
    now = [0.0]
    sessions = Sessions(cache, clock=lambda: now[0], max_tokens=512)

    def turn(name, at, pause=None):
        now[0] = at
        seq = Sequence(Request((1, 2, 3), "a0", "a0", SamplingParams(max_new_tokens=0),
                               session_id=name, session_next_s=pause))
        seq.key_ns, seq.arrival = pool_namespaces(cache.policy, seq), at
        sessions.added(seq)
        sessions.ended(seq)

    turn("tool", 0.0, pause=0.5)  # a 0.5 s tool call announced
    turn("quick", 0.0)
    now[0] = STALE_AFTER_S - 0.01
    assert sessions.stale() == []
    now[0] = STALE_AFTER_S + 0.01
    assert [s.idle_since for s in sessions.stale()] == [0.0] and sessions.stale()[0].pause_s == 0.0
    now[0] = 0.5 + STALE_AFTER_S + 0.01
    assert len(sessions.stale()) == 2
    turn("quick", 3.0)  # its next request came 3 s later: waits that long count as a turn's
    now[0] = 3.0 + 3.0 + STALE_AFTER_S - 0.01
    assert [s.pause_s for s in sessions.stale()] == [0.5]


@pytest.mark.parametrize("max_wait_s,first", [(1e9, "c"), (0.0, "b")])
def test_an_urgent_workflow_is_not_overtaken_at_the_gate(max_wait_s, first):
    """Workflow b's projection (25 pages, its hint) does not fit beside a's (19) in 39 pages,
    c's (7) does: c overtakes b at the gate, unless b has waited max_wait_s; then c waits
    behind it and b goes in when a ends."""
    engine = _engine(adapters={"a0": ADAPTERS["a0"]}, kv_cache_bytes=40 * PAGE_BYTES,
                     max_wait_s=max_wait_s)  # one agent: a workflow keeps one path
    long = SamplingParams(max_new_tokens=40, ignore_eos=True)
    a = engine.add_request(_prompt(1, 100), "a0", long, session_id="a", session_tokens=300)
    engine.step()
    b = engine.add_request(_prompt(2, 100), "a0", long, session_id="b", session_tokens=400)
    c = engine.add_request(_prompt(3, 40), "a0", long, session_id="c", session_tokens=100)
    order = []
    while engine.scheduler.has_work:
        engine.step()
        order += [n for n, s in (("b", b), ("c", c)) if s.status is not Status.WAITING and n not in order]
    assert order[0] == first
    assert all(s.error is None for s in (a, b, c))


def test_a_wrong_projection_suspends_the_youngest_workflow_and_outputs_stay_exact():
    """Hints far too small admit all four workflows (11 pages each at their first turn, 23 at
    their last, in 60 pages); as their histories grow the pool runs out and the youngest
    workflows are suspended whole, then recomputed: the outputs (float32, greedy) are those of a
    pool that never runs out."""
    one = {"a0": ADAPTERS["a0"]}
    kw = dict(turns=5, n=4, obs=40)
    want, _ = _workflows(_engine(adapters=one, kv_cache_bytes=4000 * PAGE_BYTES), ["a0"], **kw)
    engine = _engine(adapters=one, kv_cache_bytes=60 * PAGE_BYTES, max_wait_s=1e9)
    got, _ = _workflows(engine, ["a0"], hint=1, **kw)
    assert got == want
    s = engine.stats()
    assert s["workflows_running_peak"] == 4 and s["workflows_suspended"] > 0


@pytest.mark.parametrize("call,err", [
    (dict(session_id="s", session_end=1), "session_end"),
    (dict(session_id="s", session_tokens=0), "session_tokens"),
    (dict(session_id="s", session_tokens=2.5), "session_tokens"),
    (dict(session_id="s", session_next_s=-1.0), "session_next_s"),
    (dict(session_id="s", session_next_s=float("nan")), "session_next_s"),
    (dict(session_end=True), "need a session_id"),
    (dict(session_next_s=1.0), "need a session_id"),
])
def test_bad_session_arguments_are_refused(call, err):
    engine = _engine()
    with pytest.raises(ValueError, match=err):
        engine.add_request([1, 2, 3], "a0", **call)
    assert not engine.scheduler.has_work and engine.scheduler.sessions.by_id == {}


def test_bad_session_ttl_is_refused():
    with pytest.raises(ValueError, match="session_ttl_s"):
        _engine(session_ttl_s=-1)


def test_a_sessions_paths_count_each_branch_once():
    """Four mappers read one 100-token document, then their own 8-token instruction (64
    generated): one whole path and three branches from the document's 7th page; a later turn
    that extends a mapper's prompt lengthens its branch, a prompt inside a path adds nothing."""
    s = Session(0.0)
    doc = list(range(100))
    prompts = [np.asarray(doc + [200 + i] * 8, np.int32) for i in range(4)]
    for p in prompts:
        s.grow("base", "ns", p, len(p) + 64)
    assert s.pages(16) == (11 + 3 * (11 - 6), 0)
    s.grow("base", "ns", np.asarray(list(prompts[0]) + [7] * 150, np.int32), 300)
    s.grow("base", "ns", np.asarray(doc[:50], np.int32), 60)
    s.grow("res", "other", prompts[1], 172)
    assert s.pages(16) == (19 + 3 * 5, 11)


def test_with_a_host_tier_a_pausing_workflow_reserves_only_its_live_path_on_the_device():
    """Under `prefix` each of three agents keeps its own copy of a workflow's history (16 pages
    each at the end of five turns). A 50-page pool admits one workflow's three copies at a time;
    with a host tier a workflow whose requests pause (a 1 s tool call) reserves on the device
    only the path its live request uses, the idle agents' copies wait on the host: three run at
    once, an agent's second turn finds its path by copy, nothing is computed twice and the
    outputs (float32, greedy) are the same. Without the pause the tier changes nothing."""
    names, kw = ["a0", "a1", "a2"], dict(kv_cache_bytes=50 * PAGE_BYTES, max_wait_s=1e9)
    plain = _engine(**kw)
    want, _ = _workflows(plain, names, turns=5, hint=250, pause=1.0)
    hosted = _engine(host_kv_bytes=64 << 20, **kw)
    assert _workflows(hosted, names, turns=5, hint=250, pause=1.0)[0] == want
    s0, s1 = plain.stats(), hosted.stats()
    assert s0["workflows_running_peak"] == 1 and s1["workflows_running_peak"] == 3
    busy = _engine(host_kv_bytes=64 << 20, **kw)
    assert _workflows(busy, names, turns=5, hint=250)[0] == want
    assert busy.stats()["workflows_running_peak"] == 1 and busy.stats()["host_hit_tokens"] == 0
    assert s1["host_bytes_stored"] > 0 and s1["host_bytes_loaded"] > 0
    assert s1["host_hit_tokens"] > 0  # and no more is computed than with one workflow at a time
    assert s1["prefill_tokens_computed"] == s0["prefill_tokens_computed"]
    assert s1["preemptions"] == 0 and s1["workflows_suspended"] == 0


def test_session_next_s_loads_the_next_agents_path_back_before_its_next_request():
    """A session's request ends saying its next comes in 1 s (`session_next_s`); its held path
    goes to the host under pressure and is loaded back PREFETCH_LEAD_S before that time, once
    the session has shown which agent follows (here a0 follows a0): after its first request
    there is no guess, and nothing is loaded ahead."""
    cache = DualRadixCache("prefix", 16, base_pages=32, res_pages=0, base_page_bytes=1024,
                           host_kv_bytes=1 << 20)
    now = [0.0]
    sessions = Sessions(cache, clock=lambda: now[0], max_tokens=512)
    tokens = np.asarray(_prompt(5, 160), np.int32)
    for turn in range(2):
        now[0] = 2.0 * turn
        seq = Sequence(Request(tuple(tokens), "a0", "a0", SamplingParams(max_new_tokens=0),
                               session_id="w", session_next_s=1.0))
        seq.key_ns, seq.arrival = pool_namespaces(cache.policy, seq), now[0]
        sessions.added(seq).admitted = True
        handle = cache.begin(tokens, "a0")  # the request ran: its pages enter the tree
        handle.reserve(len(tokens))
        handle.commit(tokens)
        handle.release()
        sessions.ended(seq, tokens)  # the session holds its path, idle until its next request
        assert cache.evict(10) == 10 and cache.match(tokens, "a0").base_len == 0  # on the host now
        now[0] += 1.0 - PREFETCH_LEAD_S - 0.01
        sessions.prefetch()
        assert cache.match(tokens, "a0").base_len == 0
        now[0] += 0.01
        sessions.prefetch()
        assert cache.match(tokens, "a0").base_len == 160 * turn
    # Loaded when the second request began and ahead of the third; stored once: a path loaded
    # back keeps its host copy, so evicting it again copies nothing.
    assert cache.stats()["host_bytes_loaded"] == 20 * 1024 and cache.stats()["host_bytes_stored"] == 10 * 1024
    cache.check()


@pytest.mark.parametrize("leaves", [True, False])
def test_the_branch_an_agents_next_prompt_leaves_is_retired(leaves):
    """Parallel rounds: an agent's next prompt reads the shared history followed by every
    answer, not its own answer in place, so the branch its last answer left is retired: evicted
    first and never written back to the host. Where the next prompt extends the path (ReAct),
    nothing is retired and eviction writes the answer back."""
    cache = DualRadixCache("prefix", 16, base_pages=32, res_pages=0, base_page_bytes=1024,
                           host_kv_bytes=1 << 20)
    sessions = Sessions(cache, clock=lambda: 0.0, max_tokens=512)
    shared, answer = _prompt(5, 160), _prompt(6, 48)

    def added(prompt):
        seq = Sequence(Request(tuple(prompt), "a0", "a0", SamplingParams(max_new_tokens=48),
                               session_id="w"))
        seq.key_ns, seq.arrival = pool_namespaces(cache.policy, seq), 0.0
        sessions.added(seq).admitted = True
        return seq

    seq = added(shared)
    handle = cache.begin(np.asarray(shared, np.int32), "a0")
    for tokens in (shared, shared + answer):  # as the engine commits: after prefill, at the end
        tokens = np.asarray(tokens, np.int32)
        handle.reserve(len(tokens))
        handle.commit(tokens)
    handle.release()
    sessions.ended(seq, np.asarray(shared + answer, np.int32))  # the session holds the path
    added(shared + (_prompt(7, 32) if leaves else answer + _prompt(8, 16)))
    assert cache.evict(3) == 3  # the answer's pages: retired, or the least recently used
    assert cache.match(shared + answer, "a0").base_len == 160
    assert cache.stats()["host_bytes_stored"] == (0 if leaves else 3 * 1024)
    cache.check()
