"""A step program's arguments do not grow with the model's layers: the layers' parameters are
stacked (one array a projection, norm and LoRA stack, with a leading layer axis) and the layers
run under a scan, so a model twice as deep passes the same arrays, only longer."""

import jax

from forkjax import Engine
from forkjax.models.builtin import BUILTIN_CONFIGS
from forkjax.runtime.warmup_plan import step_shapes


def _decode_step_arguments(monkeypatch, layers: int) -> list:
    """The array arguments (shapes) of tiny-llama's first decode step program at `layers` layers."""
    monkeypatch.setitem(BUILTIN_CONFIGS, "tiny-llama",
                        dict(BUILTIN_CONFIGS["tiny-llama"], num_hidden_layers=layers))
    engine = Engine.from_pretrained("tiny-llama", warmup=False, progress=False, max_batch_size=4,
                                    max_model_len=256, max_prefill_tokens=64, kv_cache_bytes=1 << 22)
    try:
        runner = engine.runner
        kind, b, c, w, all_logits, hidden, fan = next(s for s in step_shapes(runner.buckets, 0, 0)[0]
                                                      if s[0] == "decode")
        lowered = runner._lower(kind, all_logits, hidden, runner._layout(b, c, w, fan))
        return [a.shape for a in jax.tree.leaves(lowered.args_info)]
    finally:
        engine.close()


def test_step_arguments_do_not_grow_with_the_layers(monkeypatch):
    two, four = _decode_step_arguments(monkeypatch, 2), _decode_step_arguments(monkeypatch, 4)
    assert len(two) == len(four) < 40, (len(two), len(four))
    # the stacked parameters and the pools carry the layers on their leading axis (the pools,
    # of one byte budget, hold half the pages at twice the layers); the rest are alike
    deeper = [(s2, s4) for s2, s4 in zip(two, four) if s2 != s4]
    assert deeper and all(s2[0] == 2 and s4[0] == 4 for s2, s4 in deeper), deeper
