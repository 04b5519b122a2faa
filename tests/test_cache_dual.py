import numpy as np
import pytest

from forkjax.cache import DualRadixCache, OutOfPages, PoolLayout

S = 4
PROMPT = np.arange(100, 118, dtype=np.int32)  # 18 tokens: 4 whole pages and 2 tokens


def _cache(policy="forkkv", base_pages=64, res_pages=64):
    return DualRadixCache(policy, S, base_pages, res_pages)


def _run(cache, tokens, adapter, commit=True, release=True):
    """Prefill a request (reserve, commit whole pages) like the engine does."""
    h = cache.begin(tokens, adapter)
    copies = h.reserve(len(tokens))
    if commit:
        h.commit(tokens)
    if release:
        h.release()
    cache.check()
    return h, copies


def test_first_request_misses_then_same_agent_hits_both_trees():
    cache = _cache()
    h, _ = _run(cache, PROMPT, "a", commit=False, release=False)
    assert (h.base_len, h.res_len, h.cached_len) == (0, 0, 0)
    assert len(h.base_page_table) == len(h.res_page_table) == 5
    h.commit(PROMPT)
    assert h.cached_len == 16  # committed whole pages are never written again
    h.release()
    h2, copies = _run(cache, np.r_[PROMPT, 1, 2], "a", commit=False, release=False)
    assert (h2.base_len, h2.res_len, h2.cached_len) == (16, 16, 16)
    assert copies == ([], [])  # the cached prefix ends on a page boundary
    base_slots, res_slots = h2.slot_mapping(0, 20)
    assert not base_slots[:16].any() and not res_slots[:16].any()  # hits are not rewritten
    assert base_slots[16:].all() and res_slots[16:].all()
    h2.release()
    cache.check()


def test_fork_maps_shared_base_read_only_and_allocates_only_residual():
    cache = _cache()
    _run(cache, PROMPT, "a")
    used = cache.stats()
    h, _ = _run(cache, PROMPT, "b", commit=False, release=False)
    assert (h.base_len, h.res_len, h.cached_len) == (16, 0, 0)
    base_slots, res_slots = h.slot_mapping(0, 18)
    assert not base_slots[:16].any() and base_slots[16:].all()  # base: only the private tail
    assert res_slots.all()  # residual: everything, into b's own pages
    a_res = cache.match(PROMPT, "a").res_pages
    assert not set(h.res_page_table.tolist()) & set(a_res.tolist())
    assert h.base_page_table[:4].tolist() == cache.match(PROMPT, "a").base_pages.tolist()
    after = cache.stats()
    assert after["base_pages_used"] - used["base_pages_used"] == 1  # the partial last page
    assert after["residual_pages_used"] - used["residual_pages_used"] == 5
    h.release()


def test_fork_inside_a_partly_shared_page_copies_it():
    cache = _cache()
    _run(cache, PROMPT, "a")
    fork = np.r_[PROMPT[:10], 7, 7, 7]  # diverges at position 10, inside page 2
    h, (base_cow, res_cow) = _run(cache, fork, "a", commit=False, release=False)
    assert (h.base_len, h.res_len) == (10, 10)
    a_base = cache.match(PROMPT, "a").base_pages
    assert base_cow == [(int(a_base[2]), int(h.base_page_table[2]))]
    assert h.base_page_table[2] != a_base[2] and h.base_page_table[:2].tolist() == a_base[:2].tolist()
    assert len(res_cow) == 1
    base_slots, _ = h.slot_mapping(0, 13)
    assert not base_slots[:10].any()
    assert (base_slots[10:] // S).tolist() == h.base_page_table[[2, 2, 3]].tolist()  # into the copy
    assert cache.match(PROMPT, "a").base_len == 16  # a's page is untouched and still cached
    h.commit(fork)  # 12 tokens: the copy becomes the new branch's first page
    assert cache.match(fork, "a").base_pages.tolist() == h.base_page_table[:3].tolist()
    h.release()
    cache.check()


def test_full_hit_ending_mid_page_copies_only_when_writing_past_it():
    cache = _cache()
    _run(cache, PROMPT, "a")
    h = cache.begin(PROMPT[:14], "a")  # everything cached, last page partly
    assert h.cached_len == 14 and h.reserve(14) == ([], [])
    base_cow, res_cow = h.reserve(15)  # decode writes position 14
    assert len(base_cow) == len(res_cow) == 1
    assert h.reserve(16) == ([], [])  # once
    h.release()
    cache.check()


def test_partial_hit_after_base_eviction_writes_base_only():
    cache = _cache()
    _run(cache, PROMPT, "a")
    assert cache.evict(100, "base") == 4
    assert cache.stats()["residual_pages_used"] == 4  # decoupled: the residual survives
    h, _ = _run(cache, PROMPT, "a", commit=False, release=False)
    assert (h.base_len, h.res_len, h.cached_len) == (0, 16, 0)
    base_slots, res_slots = h.slot_mapping(0, 18)
    assert base_slots.all() and not res_slots[:16].any() and res_slots[16:].all()
    h.commit(PROMPT)  # reinserts the recomputed base
    assert cache.match(PROMPT, "a").base_len == 16
    h.release()
    cache.check()


def test_residual_eviction_leaves_the_base():
    cache = _cache()
    _run(cache, PROMPT, "a")
    assert cache.evict(100, "residual") == 4
    m = cache.match(PROMPT, "a")
    assert (m.base_len, m.res_len) == (16, 0)


def test_running_requests_are_never_evicted():
    cache = _cache()
    h, _ = _run(cache, PROMPT, "a", release=False)
    assert cache.evict(100, "base") == 0 and cache.evict(100, "residual") == 0
    assert cache.stats()["base_pages_protected"] == 4
    h.release()
    assert cache.evict(100, "base") == 4


def test_reserve_evicts_lru_of_the_short_pool_only():
    cache = _cache(base_pages=11, res_pages=64)  # 10 usable base pages
    _run(cache, PROMPT, "a")  # 4 cached base pages
    _run(cache, PROMPT + 1000, "a")  # 4 more, newer
    h = cache.begin(PROMPT + 2000, "a")
    h.reserve(18)  # needs 5: 2 free, so the oldest leaf goes
    assert cache.match(PROMPT, "a").base_len == 0
    assert cache.match(PROMPT + 1000, "a").base_len == 16
    assert cache.match(PROMPT, "a").res_len == 16  # the residual pool was not short
    h.release()
    cache.check()


def test_out_of_pages_when_everything_is_locked():
    cache = _cache(base_pages=6)
    h, _ = _run(cache, PROMPT, "a", release=False)
    h2 = cache.begin(PROMPT + 1000, "b")
    with pytest.raises(OutOfPages, match="base pool"):
        h2.reserve(18)
    h2.release()
    h.release()
    cache.check()


def test_concurrent_duplicate_commit_frees_the_copy_and_switches_to_the_tree():
    cache = _cache()
    h1, _ = _run(cache, PROMPT, "a", commit=False, release=False)
    h2, _ = _run(cache, PROMPT, "b", commit=False, release=False)
    h1.commit(PROMPT)
    used = cache.stats()["base_pages_used"]
    h2.commit(PROMPT)  # its base pages duplicate h1's: freed, the table now reads h1's
    assert cache.stats()["base_pages_used"] == used - 4
    assert h2.base_page_table[:4].tolist() == h1.base_page_table[:4].tolist()
    assert not h2.slot_mapping(0, 16)[0].any()  # committed positions are never written again
    h1.release()
    h2.release()
    cache.check()


def test_prefix_policy_isolates_adapters_and_has_no_residual():
    cache = _cache("prefix", res_pages=1)
    _run(cache, PROMPT, "a")
    assert cache.match(PROMPT, "b").base_len == 0
    assert cache.match(PROMPT, "a").base_len == 16
    h, _ = _run(cache, PROMPT, "a", release=False)
    assert h.res is None and not h.res_page_table.any() and len(h.res_page_table) == 5
    assert not h.slot_mapping(0, 18)[1].any()
    h.release()


def test_full_reuse_shares_base_across_adapters():
    cache = _cache("full_reuse", res_pages=1)
    _run(cache, PROMPT, "a")
    h, _ = _run(cache, PROMPT, "b", release=False)
    assert (h.base_len, h.res_len, h.cached_len) == (16, 0, 16)
    h.release()


def test_lrshared_shares_residual_across_adapters():
    cache = _cache("lrshared")
    _run(cache, PROMPT, "a")
    h, _ = _run(cache, PROMPT, "b", release=False)
    assert (h.base_len, h.res_len) == (16, 16)
    h.release()
    assert cache.stats()["agent_bytes"] == {}  # nothing is private to one adapter


def test_bare_base_model_shares_base_and_keeps_no_residual():
    cache = _cache()
    _run(cache, PROMPT, "a")
    h, _ = _run(cache, PROMPT, None, release=False)
    assert (h.base_len, h.res_len, h.cached_len) == (16, 0, 16)
    assert h.res is None and not h.res_page_table.any()
    h.release()
    assert cache.stats()["residual_pages_used"] == 4  # a's only


def test_stats_keys_hits_and_byte_accounting():
    cache = DualRadixCache("forkkv", S, 64, 64, base_page_bytes=1000, res_page_bytes=10)
    _run(cache, PROMPT, "a")
    h, _ = _run(cache, PROMPT, "b", release=False)
    st = cache.stats()
    for key in ("base_pages_total", "base_pages_used", "residual_pages_total", "residual_pages_used",
                "base_bytes_used", "residual_bytes_used", "prompt_tokens", "base_hit_tokens",
                "residual_hit_tokens"):
        assert key in st
    assert (st["prompt_tokens"], st["base_hit_tokens"], st["residual_hit_tokens"]) == (36, 16, 0)
    assert st["base_pages_total"] == 63 and st["base_bytes_used"] == 1000 * st["base_pages_used"]
    # a: 4 residual pages in its tree; b: 5 private residual pages + 1 private base page (its tail).
    assert st["agent_bytes"] == {"a": 40, "b": 50 + 1000}
    assert st["shared_bytes"] == 4000
    assert sum(st["agent_bytes"].values()) + st["shared_bytes"] == st["base_bytes_used"] + st["residual_bytes_used"]
    h.release()


def test_from_layout_uses_layout_sizes():
    lay = PoolLayout(num_layers=2, num_kv_heads=2, head_dim=8, lora_rank=4, page_size=4, dtype="float32",
                     base_pages=10, res_pages=20, policy=DualRadixCache("forkkv", 4, 2, 2).policy)
    cache = DualRadixCache.from_layout(lay)
    st = cache.stats()
    assert (st["base_pages_total"], st["residual_pages_total"]) == (9, 19)
    assert cache.base_page_bytes == lay.base_page_bytes == 2 * 2 * 2 * 4 * 8 * 4


@pytest.mark.parametrize("num_agents", [2, 8, 32])
def test_forkkv_memory_is_one_over_n_plus_r_over_n_of_prefix(num_agents):
    """N agents running on one 16k-token prefix; each has a private partial last page."""
    lay = dict(num_layers=4, num_kv_heads=4, head_dim=64, lora_rank=16, page_size=16, dtype="bfloat16")
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 32000, 16384 + 5, dtype=np.int32)
    prompts = [np.r_[prefix, rng.integers(0, 32000, int(rng.integers(1, 11)), dtype=np.int32)]
               for _ in range(num_agents)]
    used = {}
    for policy in ("forkkv", "prefix"):
        layout = PoolLayout.from_budget(**lay, kv_cache_bytes=8 << 30, policy=policy)
        cache = DualRadixCache.from_layout(layout)
        handles = []
        for i, p in enumerate(prompts):
            h = cache.begin(p, f"agent{i}")
            h.reserve(len(p))
            h.commit(p)
            handles.append(h)  # all agents running: nothing evictable, nothing freed
        st = cache.stats()
        used[policy] = st["base_bytes_used"] + st["residual_bytes_used"]
        cache.check()
    r_over_n = 16 / (4 * 64)
    assert used["forkkv"] / used["prefix"] == pytest.approx(1 / num_agents + r_over_n, rel=0.05)


def test_hits_count_once_per_admitted_request():
    """Counted at the first successful reserve: not at a begin that is released unreserved (a
    request waiting for pages), not at a re-admission the engine marks count_hits=False."""
    cache = DualRadixCache("forkkv", S, 64, 64, base_page_bytes=1000, res_page_bytes=10)
    _run(cache, PROMPT, "a")
    cache.begin(PROMPT, "a").release()
    h = cache.begin(PROMPT, "a", count_hits=False)
    h.reserve(len(PROMPT))
    h.reserve(len(PROMPT) + 1)
    h.release()
    st = cache.stats()
    assert (st["prompt_tokens"], st["base_hit_tokens"]) == (len(PROMPT), 0)
    h, _ = _run(cache, PROMPT, "a")
    st = cache.stats()
    assert (st["prompt_tokens"], st["base_hit_tokens"]) == (2 * len(PROMPT), h.base_len)
    assert h.base_len > 0
