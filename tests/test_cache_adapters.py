import numpy as np
import pytest

from forkjax.cache import SHARED, DualRadixCache, adapter_fingerprint, check_shared_lora_a, get_policy


def _adapter(seed, rank=4, modules=("k_proj", "v_proj", "q_proj")):
    rng = np.random.default_rng(seed)
    return {f"layers.{i}.{m}": rng.standard_normal((32, rank)).astype(np.float32) for i in range(2) for m in modules}


@pytest.mark.parametrize("name,base_ns,res_ns", [
    ("prefix", "A", None),
    ("full_reuse", SHARED, None),
    ("forkkv", SHARED, "A"),
    ("lrshared", SHARED, SHARED),
])
def test_policy_namespaces(name, base_ns, res_ns):
    pol = get_policy(name)
    assert pol.base_ns("A") == base_ns
    assert pol.res_ns("A") == res_ns
    assert pol.res_ns(None) is None  # the bare base model never keeps a residual


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="forkkv"):
        get_policy("fork")


def test_fingerprint_is_content_not_name():
    w = _adapter(0)
    assert adapter_fingerprint(w) == adapter_fingerprint({k: v.copy() for k, v in w.items()})
    w2 = dict(w)
    w2["layers.0.k_proj"] = w["layers.0.k_proj"] + 1e-3
    assert adapter_fingerprint(w2) != adapter_fingerprint(w)
    assert adapter_fingerprint(w, {"scale": 2.0}) != adapter_fingerprint(w, {"scale": 1.0})
    assert adapter_fingerprint(w) != adapter_fingerprint({k: v.astype(np.float16) for k, v in w.items()})


def test_reloading_an_adapter_with_new_weights_never_hits_its_old_residuals():
    """vLLM #30931: same name, new weights, stale cache. Keys are content hashes, so no reuse."""
    cache = DualRadixCache("forkkv", 4, 32, 32)
    tokens = np.arange(1, 17, dtype=np.int32)
    old_key = adapter_fingerprint(_adapter(0))
    h = cache.begin(tokens, old_key)
    h.reserve(16)
    h.commit(tokens)
    h.release()
    new_key = adapter_fingerprint(_adapter(1))  # "agent" reloaded with other weights
    m = cache.match(tokens, new_key)
    assert m.res_len == 0 and m.base_len == 16  # base is adapter-free under forkkv
    assert cache.match(tokens, adapter_fingerprint(_adapter(0))).res_len == 16  # same weights: valid


def test_shared_a_passes_within_tolerance_and_ignores_other_modules():
    a = _adapter(0)
    b = {k: (v * (1 + 1e-5) if "q_proj" not in k else v + 5.0) for k, v in a.items()}
    check_shared_lora_a({"a": a, "b": b})
    check_shared_lora_a({"only": a})


def test_different_a_is_refused_naming_adapters_and_module():
    a, b = _adapter(0), _adapter(0)
    b["layers.1.v_proj"] = b["layers.1.v_proj"] + 0.5
    with pytest.raises(ValueError, match=r"layers\.1\.v_proj.*'a'.*'b'"):
        check_shared_lora_a({"a": a, "b": b})


def test_different_rank_is_refused():
    with pytest.raises(ValueError, match="rank"):
        check_shared_lora_a({"a": _adapter(0, rank=4), "b": _adapter(0, rank=8)})


def test_different_kv_targets_are_refused():
    with pytest.raises(ValueError, match="targets.*v_proj"):
        check_shared_lora_a({"a": _adapter(0), "b": _adapter(0, modules=("k_proj", "q_proj"))})
