"""The engine with a host tier (`host_kv_bytes`): agents whose histories were pushed off a small
device pool come back for their next turn and find them on the host. Their outputs (float32,
greedy) equal those of an unlimited pool under every policy, the loaded pages are counted, and
nothing more is computed than in a pool that never evicts; `flush_cache` empties both tiers."""

from __future__ import annotations

import pytest

import forkjax
from conftest import SMALL
from test_engine_cache import _mild_adapters, _prompt, _shared_a_adapters

# every policy: one pool (prefix, full_reuse), a base pool and per-agent residuals (forkkv,
# with fan-out), one shared residual (lrshared)
POLICIES = ("prefix", "full_reuse", "forkkv", "forkkv+fanout", "lrshared")


def _turns(engine, names, histories, suffixes):
    """Two turns of every agent, one agent at a time: its history, then the history, the answer
    and a new observation."""
    first = [engine.generate([h], adapters=[n], max_new_tokens=4)[0] for n, h in zip(names, histories)]
    second = [engine.generate([h + a + s], adapters=[n], max_new_tokens=4)[0]
              for n, h, a, s in zip(names, histories, first, suffixes)]
    return first, second


@pytest.mark.parametrize("policy", POLICIES)
def test_agents_find_their_histories_on_the_host(policy):
    adapters = _shared_a_adapters(3) if policy == "lrshared" else _mild_adapters(3)
    names = list(adapters)[:2] * 2
    histories = [_prompt(40 + i, 96 + 8 * i) for i in range(4)]  # distinct: exact per agent
    suffixes = [_prompt(60 + i, 12) for i in range(4)]
    kw = dict(SMALL, adapters=adapters, dtype="float32", cache_policy=policy.removesuffix("+fanout"),
              residual_fanout=policy.endswith("+fanout"))
    with forkjax.Engine.from_pretrained("tiny-llama", **kw) as engine:
        want, unlimited = _turns(engine, names, histories, suffixes), engine.stats()
    # Room for about two histories on the device (a tiny-llama base page is 32 KiB, a residual
    # page 8 KiB per adapter), the rest on the host; the pool of test_engine_cache's memory
    # pressure test, whose compiled programs this one reuses.
    kw["kv_cache_bytes"] = 20 * (32768 + (3 * 8192 if policy.startswith("forkkv") else 0))
    with forkjax.Engine.from_pretrained("tiny-llama", host_kv_bytes=64 << 20, **kw) as engine:
        assert _turns(engine, names, histories, suffixes) == want
        s = engine.stats()
    assert s["evicted_base_pages"] > 0 and s["host_bytes_stored"] > 0
    assert s["host_bytes_loaded"] > 0 and s["host_hit_tokens"] > 0
    # Nothing evicted is recomputed: the pool that never evicts computes the same positions.
    assert s["prefill_tokens_computed"] == unlimited["prefill_tokens_computed"]
    assert 0 < s["host_bytes_used"] <= s["host_bytes_total"] == 64 << 20


def test_flush_empties_both_tiers():
    kw = dict(SMALL, adapters=_mild_adapters(1), dtype="float32", kv_cache_bytes=8 * 32768 * 2)
    with forkjax.Engine.from_pretrained("tiny-llama", host_kv_bytes=16 << 20, **kw) as engine:
        for i in range(4):
            engine.generate([_prompt(80 + i, 100)], adapters=["a0"], max_new_tokens=2)
        assert engine.stats()["host_bytes_used"] > 0
        engine.flush_cache()
        s = engine.stats()
        assert s["host_bytes_used"] == 0 and s["base_pages_used"] == 0
        engine.cache.check()
        # A prompt seen before is computed again, not loaded.
        engine.generate([_prompt(80, 100)], adapters=["a0"], max_new_tokens=2)
        assert engine.stats()["host_hit_tokens"] == 0


@pytest.mark.parametrize("pool", ["base", "residual"])
def test_a_hit_split_across_the_tiers_is_exact(pool):
    """`forkkv`: one pool's pages of an agent's history on the host, the other pool's on the
    device. The next turn loads the first back and matches the second where they are: its
    output and the positions it computes are those of a pool that never evicts."""
    kw = dict(SMALL, adapters=_mild_adapters(2), dtype="float32", cache_policy="forkkv")
    hist, suffix = _prompt(70, 100), _prompt(71, 12)
    with forkjax.Engine.from_pretrained("tiny-llama", **kw) as engine:
        answer = engine.generate([hist], adapters=["a0"], max_new_tokens=4)[0]
        want = engine.generate([hist + answer + suffix], adapters=["a0"], max_new_tokens=4)[0]
        computed = engine.stats()["prefill_tokens_computed"]
    with forkjax.Engine.from_pretrained("tiny-llama", host_kv_bytes=16 << 20, **kw) as engine:
        assert engine.generate([hist], adapters=["a0"], max_new_tokens=4)[0] == answer
        assert engine.cache.evict(1 << 20, pool) > 0  # every unlocked page of one pool
        assert engine.generate([hist + answer + suffix], adapters=["a0"], max_new_tokens=4)[0] == want
        s = engine.stats()
        engine.cache.check()
    assert s["host_bytes_loaded"] > 0 and s["prefill_tokens_computed"] == computed


def test_host_pages_keep_their_salt_and_their_adapters_weights():
    """A request of another `cache_salt`, or of an adapter reloaded under the same name, never
    hits host pages it could not hit on the device: it computes its prompt, and its output is
    that of an engine that never saw the first request."""
    adapters, new = _mild_adapters(2), _mild_adapters(3)["a2"]
    kw = dict(SMALL, dtype="float32", cache_policy="prefix")
    hist = _prompt(72, 100)
    with forkjax.Engine.from_pretrained("tiny-llama", adapters={"a0": new}, **kw) as engine:
        reloaded = engine.generate([hist], adapters=["a0"], max_new_tokens=4)[0]
    with forkjax.Engine.from_pretrained("tiny-llama", adapters=adapters, host_kv_bytes=16 << 20,
                                        **kw) as engine:
        first = engine.generate([hist], adapters=["a0"], max_new_tokens=4, cache_salt="team-a")[0]
        engine.cache.evict(1 << 20)
        engine.generate([hist], adapters=["a0"], max_new_tokens=4, cache_salt="team-b")
        assert engine.stats()["host_hit_tokens"] == 0
        assert engine.generate([hist], adapters=["a0"], max_new_tokens=4, cache_salt="team-a")[0] == first
        hits = engine.stats()["host_hit_tokens"]
        assert hits > 0
        engine.generate([hist], adapters=["a0"], max_new_tokens=4)  # unsalted, the old weights
        engine.cache.evict(1 << 20)
        engine.load_adapter("a0", new)
        assert engine.generate([hist], adapters=["a0"], max_new_tokens=4)[0] == reloaded
        assert engine.stats()["host_hit_tokens"] == hits
