"""Byte sizes, as the engine's keywords and every command line take them: the one place they are
parsed, so that `--kv-cache-bytes 16G` means the same to every script, the server and
`Engine.from_pretrained(kv_cache_bytes="16G")`.

A size is an int >= 0, a finite float >= 0 (60e9; rounded down to whole bytes), or a string:
  - a number: "268435456", "60e9", "1.5e9", "0.5";
  - a number and a decimal unit, any case: "60GB", "60 gb", "1.5kB" (kB, MB, GB, TB: 10**3 .. 10**12);
  - a number and a binary unit, any case: "2GiB", "256MiB", "4KiB", "1TiB" (2**10 .. 2**40);
  - a number and one letter, as vLLM reads them: lower case is decimal (k, m, g, t: 10**3 ..
    10**12), upper case binary (K, M, G, T: 2**10 .. 2**40); so "60g" is 60*10**9, "60G" 60*2**30.
Whitespace around the number and unit is ignored. Fractions of a byte are dropped.

Pure Python: the HTTP front end imports it before jax.
"""

from __future__ import annotations

import argparse
import math
import numbers
import re
from fractions import Fraction

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_SIZE = re.compile(r"\s*((?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*")
EXAMPLES = "e.g. 268435456, 60e9, 16GB, 16GiB, 16G"


def parse_size(value) -> int:
    """Bytes that `value` (an int, a float or a string, module docstring) stands for; ValueError
    for anything else, negative and non-finite numbers included."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        if value >= 0:
            return int(value)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        if math.isfinite(value) and value >= 0:
            return math.floor(value)
    elif isinstance(value, str):
        match = _SIZE.fullmatch(value)
        unit = _unit(match.group(2)) if match else None
        if unit is not None:
            # Fraction: exact decimal arithmetic, so "0.3GB" is 300000000, not a float's 299999999
            return math.floor(Fraction(match.group(1)) * unit)
    raise ValueError(f"{value!r} is not a size ({EXAMPLES})")


def _unit(suffix: str) -> int | None:
    """The multiplier `suffix` names, None if it names none."""
    if not suffix:
        return 1
    letter = suffix[0].lower()
    if letter not in _DECIMAL:
        return None
    if len(suffix) == 1:  # vLLM's single letters: the case says decimal or binary
        return _DECIMAL[letter] if suffix.islower() else _BINARY[letter]
    if suffix[1:].lower() == "b":
        return _DECIMAL[letter]
    if suffix[1:].lower() == "ib":
        return _BINARY[letter]
    return None


def size_flag(text: str) -> int:
    """`parse_size` as an argparse `type=`: a bad size is a usage error naming the flag."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
