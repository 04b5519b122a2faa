"""Disaggregated paged KV cache (ForkKV §5.2; docs/design.md, The idea and Policies).

Two page pools (pool.py): the base pool holds x·W K/V (RoPE on K), the residual pool x·A_k and
x·A_v. Each pool has a host allocator with refcounts (allocator.py) and a radix tree
(radix_tree.py, its nodes tree_node.py); DualRadixCache (dual_cache.py) runs both trees under
one of the four policies (policy.py). Trees have token-granular keys and page-granular storage;
only whole pages are ever inserted, a request's partial last page stays private to it.

How the engine drives one request (`h = cache.begin(prompt, adapter_key)`):

1. Prefill. `h.base_len` / `h.res_len` are the cached prefix lengths in each tree (locked now).
   Positions below `h.cached_len` (= min of the two, or base_len without a residual) are full
   hits: no compute. Compute positions [h.cached_len, len(prompt)) (at least the last prompt
   token, for its logits), after `base_cow, res_cow = h.reserve(len(prompt))`:
     * copy the copy-on-write pairs first (the runtime's `copy_pages`) (a cached prefix ending inside a page
       shares that page; this request gets its own copy before writing its tail into it);
     * `base_slots, res_slots = h.slot_mapping(h.cached_len, len(prompt))` give the write slots,
       0 (the sink) where that pool already has the token. So base hit + residual miss writes the
       residual only (a new agent forking a prefix), residual hit + base miss (base evicted: a
       partial hit) writes the base only, and attention reads every position from the cache
       after the write: a request reusing another agent's base sees that base, not its own;
     * page tables: `h.base_page_table`, `h.res_page_table` (same length; the residual one is
       all sink pages when the request keeps no residual, and the kernel gets b_k = b_v = 0).
   Then `h.commit(prompt)` so that concurrent requests share the prompt's whole pages.
2. Decode. Before each step `h.reserve(num_tokens_after_this_step)` (may return a copy-on-write
   pair the first time it writes past a cached prefix ending mid-page) and
   `h.slot_mapping(pos, pos + 1)` for the new token.
3. Finish. `h.commit(tokens_with_kv)` (prompt + generated tokens whose K/V was written, i.e. not
   the last sampled token), then `h.release()`. Abort / preemption: `h.release()` alone.

`reserve` evicts LRU unlocked leaves of the short pool only (decoupled eviction: the base and
residual trees never evict each other) and raises OutOfPages when that is not enough. Adapter
keys are the adapter's content hash (adapters.adapter_fingerprint), None for the bare base model,
which keeps no residual under any policy.
"""

from forkjax.cache.adapters import adapter_fingerprint, check_shared_lora_a
from forkjax.cache.allocator import PageAllocator
from forkjax.cache.dual_cache import DualRadixCache, MatchResult
from forkjax.cache.hold import PrefixHold
from forkjax.cache.policy import POLICIES, SHARED, CachePolicy, get_policy
from forkjax.cache.pool import PoolLayout, residual_copies_for
from forkjax.cache.radix_tree import RadixTree
from forkjax.cache.seq_cache import OutOfPages, SeqCache
from forkjax.cache.tree_node import TreeNode

__all__ = [
    "POLICIES", "SHARED", "CachePolicy", "DualRadixCache", "MatchResult", "OutOfPages",
    "PageAllocator", "PoolLayout", "PrefixHold", "RadixTree", "SeqCache", "TreeNode", "adapter_fingerprint",
    "check_shared_lora_a", "get_policy", "residual_copies_for",
]
