"""The sgmv LoRA path (lora_path="sgmv": A apart, each token's shrink and expand against its own
slot in the SGMV kernels, interpreted on the CPU) against float64 transformers + PEFT and the
fused path, with more adapters than slots (swaps write lora_a), and with residual fan-out
(every slot's xA from a GEMM of its own)."""

import numpy as np

import forkjax
from conftest import SMALL
from hf_utils import hf_logits, load_hf, rel_err


def _prompt(seed, n, vocab):
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, n)]


def test_sgmv_path_matches_peft_and_the_fused_path(hf_suite, engine_for):
    base, adapters = hf_suite["llama"]
    sgmv = forkjax.Engine.from_pretrained(base, adapters=adapters, dtype="float32", cache_policy="prefix",
                                          lora_path="sgmv", max_loras=3, **SMALL)
    assert len(adapters) > 2  # fewer slots than adapters: requests swap them in
    fused = engine_for("llama", "float32")
    prompt = _prompt(3, 45, 203)
    names = sorted(adapters)
    for name in names[:3]:
        got = sgmv.score(prompt, adapter=name)
        assert rel_err(got, hf_logits(load_hf(base, adapter_dir=adapters[name]), prompt)) < 1e-4
        assert rel_err(got, fused.score(prompt, adapter=name)) < 1e-5
    assert sgmv.stats()["lora_swaps"] > 0
    # a mixed batch, the base model among it: the same greedy tokens as the fused path
    prompts = [_prompt(10 + i, 20 + 7 * i, 203) for i in range(4)]
    mixed = [names[0], None, names[1], names[0]]
    assert sgmv.generate(prompts, adapters=mixed, max_new_tokens=6) == \
        fused.generate(prompts, adapters=mixed, max_new_tokens=6)


def test_sgmv_path_with_residual_fanout_equals_the_fused_path():
    kw = dict(SMALL, dtype="float32", cache_policy="forkkv", residual_fanout=True)
    outs = []
    for path in ("fused", "sgmv"):
        engine = forkjax.Engine.from_pretrained("tiny-llama", lora_path=path, **kw)
        names = sorted(engine.slots.by_name)
        context = _prompt(1, 48, 250)
        engine.generate([context], adapters=[names[0]], max_new_tokens=1)  # fans out to the others
        outs.append(engine.generate([context + _prompt(2, 9, 250)] * 2, adapters=names[1:3], max_new_tokens=6))
        assert engine.stats()["residual_hit_tokens"] > 0
    assert outs[0] == outs[1]
