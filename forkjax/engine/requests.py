"""Validation of what a request brings: its prompt, its adapter's cache key, its cache salt, its
session fields and its fan-out group (InvalidArgument or KeyError, naming what is wrong, before
anything is queued)."""

from __future__ import annotations

from forkjax.cache.policy import Activated, salted
from forkjax.config import EngineConfig
from forkjax.lora.activated import invocation_start
from forkjax.lora.slots import AdapterSlots


class InvalidArgument(ValueError):
    """A request's argument `param` (its name in `add_request`) is wrong: a server answers
    naming that field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def prompt_ids(prompt, tokenizer, vocab_size: int, max_model_len: int) -> list[int]:
    """A string (tokenized) or token ids -> token ids within the vocabulary and the context."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidArgument("prompt", "string prompts need a tokenizer; this model has none: "
                                            "pass token ids")
        prompt = tokenizer.encode(prompt)
    try:
        ids = [int(t) for t in prompt]
    except (TypeError, ValueError):
        raise InvalidArgument("prompt", "a prompt must be a string or a list of token ids") from None
    if not ids:
        raise InvalidArgument("prompt", "empty prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument("prompt", f"token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    if len(ids) > max_model_len:
        raise InvalidArgument("prompt", f"prompt of {len(ids)} tokens exceeds the context of "
                                        f"{max_model_len}")
    return ids


def adapter_key(slots: AdapterSlots, adapter: str | None, ids: list[int], salt: str | None):
    """The cache key of a request of `adapter` (KeyError for an unknown one) on prompt `ids`: an
    Activated LoRA adapter's (`Activated`) acts from its invocation's last occurrence on."""
    key = slots.key_of(adapter)
    invocation = slots.invocation_of(adapter)
    if invocation is not None:
        start = invocation_start(ids, invocation)
        if start < 0:
            raise InvalidArgument("prompt", f"adapter {adapter!r} is an Activated LoRA adapter: its "
                                            f"prompt must hold its invocation tokens {list(invocation)}, "
                                            "and this one does not")
        key = Activated(key, slots.alora_tags[key], start)
    return salted(key, salt)


def check_salt(cache_salt) -> str | None:
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise InvalidArgument("cache_salt", f"cache_salt={cache_salt!r}: expected a non-empty string")
    return cache_salt


def check_session(session_id, session_end, session_tokens, session_next_s=None) -> None:
    if session_id is not None and not isinstance(session_id, str):
        raise InvalidArgument("session_id", f"session_id={session_id!r}: expected a string")
    if not isinstance(session_end, bool):
        raise InvalidArgument("session_end", f"session_end={session_end!r}: expected a bool")
    if session_tokens is not None and (isinstance(session_tokens, bool) or not isinstance(
            session_tokens, int) or session_tokens < 1):
        raise InvalidArgument("session_tokens",
                              f"session_tokens={session_tokens!r}: expected an int >= 1")
    if session_next_s is not None and (isinstance(session_next_s, bool) or not isinstance(
            session_next_s, (int, float)) or not 0 <= session_next_s < float("inf")):
        raise InvalidArgument("session_next_s",
                              f"session_next_s={session_next_s!r}: expected seconds >= 0")
    if session_id is None and (session_end or session_tokens is not None
                               or session_next_s is not None):
        given = "session_end" if session_end else "session_tokens" if session_tokens is not None \
            else "session_next_s"
        raise InvalidArgument(given, "session_end, session_tokens and session_next_s need a session_id")


def slot_fanout(slots: AdapterSlots, own: str | None, width: int) -> list[str]:
    """Whom a `residual_fanout` request without `fanout_adapters` fans out to: the other adapters
    in device slots now, the first `width` (`fanout_width`: at most the slots beside its own;
    never an Activated LoRA adapter, which keeps no residual, nor from one)."""
    if slots.invocation_of(own) is not None:
        return []
    return [n for n in slots.slot_by_name if n != own and slots.invocation_of(n) is None][:width]


def fanout_targets(slots: AdapterSlots, config: EngineConfig, own: str | None, own_key, names,
                   salt: str | None = None) -> dict:
    """`fanout_adapters` -> {adapter name: cache key} of the residuals a request on adapter
    `own` writes besides its own (within its `salt`): None follows `config.residual_fanout`
    (none, or the other adapters in device slots now: every loaded one while they fit in
    `max_loras`, at most `max_fanout_adapters`). ValueError if they are more than
    `max_fanout_adapters` or they and `own` cannot be in device slots at once."""
    default = names is None
    if default:
        names = slot_fanout(slots, own, config.fanout_width) if config.residual_fanout else []
    elif isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise InvalidArgument("fanout_adapters",
                              f"fanout_adapters={names!r}: expected a list of adapter names")
    names = list(names)
    if names and config.cache_policy != "forkkv":
        raise InvalidArgument("fanout_adapters", "residual fan-out needs cache_policy='forkkv', "
                                                 f"not {config.cache_policy!r}")
    alora = [n for n in [own, *names] if slots.invocation_of(n) is not None]
    if names and alora:
        raise InvalidArgument("fanout_adapters", f"adapter {alora[0]!r} is an Activated LoRA adapter, "
                                                 "whose requests keep no residual: no fan-out to or from it")
    out, keys = {}, {own_key}
    for name in names:
        key = salted(slots.key_of(name), salt)  # KeyError for an unknown one
        if key not in keys:  # the same weights under two names share one residual
            keys.add(key)
            out[name] = key
    if len(out) > config.fanout_width:
        raise InvalidArgument("fanout_adapters", f"fanout_adapters names {len(out)} adapters, more "
                              f"than the engine's max_fanout_adapters={config.fanout_width} (a width "
                              "of its compiled step; set it at start, up to max_loras - 2)")
    if default:  # the default fans out to those that fit beside the request's own adapter
        fit = {}
        for name, key in out.items():
            need = {own, *fit, name} - {None}
            if len(need) <= _room(slots, need):
                fit[name] = key
        out = fit
    need = {own, *out} - {None}
    room = _room(slots, need)
    if len(need) > room:
        raise InvalidArgument("fanout_adapters", f"the request needs {len(need)} adapters in device "
                              f"slots at once (its own and its fan-out targets) but {room} slots can "
                              f"take them (max_loras={slots.num_slots}, pinned: {sorted(slots.pinned)})")
    return out


def _room(slots: AdapterSlots, need: set) -> int:
    """Device slots adapters `need` can take at once: all but the base model's and those of the
    other pinned adapters."""
    return slots.num_slots - 1 - len(slots.pinned - need)
