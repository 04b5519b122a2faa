"""The aLoRA form of the directory tasks (forkjax/workflows/tasks.py) on SmolLM2's tokenizer:
each role's invocation keeps its token ids inside the text of a whole prompt, as a server
tokenizes it, and PEFT's aLoRA finds it where `make_prompt` put it, right after the directory."""

import numpy as np
import pytest
import torch

from forkjax.workflows import tasks


@pytest.fixture(scope="module")
def tok(smol_file):
    from forkjax.models.gguf import GGUFCheckpoint
    return GGUFCheckpoint(smol_file).tokenizer().tok


def _prompts(tok):
    """An aLoRA prompt of every role on directories of 1, 3 and 12 records."""
    rng = np.random.default_rng(5)
    return [tasks.make_prompt(tok, role, tasks.directory(rng, n), rng, alora=True)
            for n in (1, 3, 12) for role in tasks.ROLES]


def _last(ids: list[int], sub: list[int]) -> int:
    """Where the last occurrence of `sub` in `ids` starts; -1 if none."""
    return max((i for i in range(len(ids) - len(sub) + 1) if ids[i:i + len(sub)] == sub), default=-1)


def test_each_role_has_its_own_invocation(tok):
    ids = {role: tasks.invocation_ids(tok, role) for role in tasks.ROLES}
    assert all(ids.values()) and len({tuple(v) for v in ids.values()}) == len(tasks.ROLES)
    for role, inv in ids.items():  # one role's invocation is no part of another's
        assert all(_last(other, inv) < 0 for r, other in ids.items() if r != role), role


def test_invocation_tokens_are_the_same_inside_a_prompts_text(tok):
    head, tail = tasks.chat_pieces(tok)
    for p in _prompts(tok):
        inv = tasks.invocation_ids(tok, p.role)
        assert p.task[:len(inv)] == inv
        text = tok.decode(p.context + p.task)
        # the prompt is the chat template's text of one user message
        message = text.removeprefix(head).removesuffix(tail)
        assert tok.apply_chat_template([{"role": "user", "content": message}],
                                       add_generation_prompt=True, tokenize=False) == text
        whole = tok.encode(text, add_special_tokens=False)
        start = _last(whole, inv)
        assert start > 0, p.role
        assert tok.decode(whole[:start]) == tok.decode(p.context), p.role  # right after the directory


def test_peft_finds_the_invocation_where_make_prompt_put_it(tok):
    import peft
    from peft.tuners.lora.variants import calculate_alora_offsets
    configs = {role: peft.LoraConfig(r=8, target_modules=["q_proj"], task_type="CAUSAL_LM",
                                     alora_invocation_tokens=tasks.invocation_ids(tok, role))
               for role in tasks.ROLES}
    for p in _prompts(tok):
        ids = p.context + p.task + p.answer
        batch = torch.tensor([ids] * len(tasks.ROLES))
        offsets = calculate_alora_offsets(configs, p.role, batch, adapter_names=list(tasks.ROLES))
        # the adapter of p's role starts at the invocation; the other roles' find none
        assert offsets == [len(ids) - len(p.context) if r == p.role else None for r in tasks.ROLES]
