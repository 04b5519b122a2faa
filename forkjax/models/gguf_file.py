"""GGUF's container format (llama.cpp's gguf.md, versions 2 and 3): the metadata key-values and
the tensor directory, read straight from the file's bytes; tensor data is a memory map.

The `gguf` package's GGUFReader builds a numpy view per metadata element, which for a 49k-token
vocabulary and its 49k merges takes ~6 s; reading the same fields here takes well under one. The
`gguf` package still dequantizes (models/gguf.py).
"""

from __future__ import annotations

import dataclasses
import mmap
import struct

import numpy as np

# value type id -> struct format (little-endian); 8 is a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (GGUF lists dimensions innermost first)
    tensor_type: int  # gguf.GGMLQuantizationType value
    offset: int  # from the file's start
    nbytes: int


class _Cursor:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.take("I"), self.take("Q")
            if etype in _SCALARS:  # one unpack for the whole array
                fmt = _SCALARS[etype]
                size = struct.calcsize(fmt) * n
                if self.pos + size > len(self.buf):
                    raise ValueError("an array runs past the end of the file")
                out = np.frombuffer(self.buf, "<" + fmt, n, self.pos).tolist()
                self.pos += size
                return out
            return [self.value(etype) for _ in range(n)]
        if vtype not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {vtype}")
        return self.take(_SCALARS[vtype])


def read_gguf(path: str) -> tuple[dict, dict[str, TensorInfo], np.ndarray]:
    """-> (metadata {key: value}, {tensor name: TensorInfo}, the file as a uint8 memory map).
    ValueError for a file that is not GGUF or is cut short."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file
            raise ValueError("an empty file") from None
    c = _Cursor(buf)
    try:
        magic, version = c.take("4s"), c.take("I")
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"not a GGUF file of version 2 or 3 (magic {magic!r}, version {version})")
        n_tensors, n_kv = c.take("Q"), c.take("Q")
        meta = {}
        for _ in range(n_kv):
            key = c.string()
            meta[key] = c.value(c.take("I"))
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            dims = [c.take("Q") for _ in range(c.take("I"))]
            infos.append((name, dims, c.take("I"), c.take("Q")))
    except struct.error:
        raise ValueError("the header runs past the end of the file") from None
    align = meta.get("general.alignment", 32)
    start = -(-c.pos // align) * align
    tensors = {}
    for name, dims, ttype, offset in infos:
        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        except ValueError:
            raise ValueError(f"tensor {name}: unknown GGUF type {ttype}") from None
        count = int(np.prod(dims))
        nbytes = count // block * size
        if start + offset + nbytes > len(buf):
            raise ValueError(f"tensor {name} runs past the end of the file")
        tensors[name] = TensorInfo(name, tuple(reversed(dims)), ttype, start + offset, nbytes)
    return meta, tensors, np.frombuffer(buf, np.uint8)


def tensor_data(data: np.ndarray, t: TensorInfo) -> np.ndarray:
    """The tensor's stored values: typed for float types, else uint8 rows of quant blocks (the
    layout `gguf.quants.dequantize` takes)."""
    from gguf import GGMLQuantizationType as Q
    raw = data[t.offset:t.offset + t.nbytes]
    typed = {Q.F32: np.float32, Q.F16: np.float16, Q.F64: np.float64, Q.I8: np.int8,
             Q.I16: np.int16, Q.I32: np.int32, Q.I64: np.int64}.get(Q(t.tensor_type))
    if typed is not None:
        return raw.view(typed).reshape(t.shape)
    return raw.reshape(*t.shape[:-1], -1)
