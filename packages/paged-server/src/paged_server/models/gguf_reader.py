"""A GGUF file's header read fast: its metadata, and its tensors memory-mapped.

gguf-py's ``GGUFReader`` builds numpy views for every element of every
array, which took 11.8 s for a 151k-token vocabulary and its merges (a
Qwen or Llama 3 file) on a 2-core machine, once per process that opens the
file. This reads the same header with one ``struct`` call per value (what
llama.cpp writes: little-endian, version 2 or 3) and hands back the
tensors as views into one memory map, shaped as ``GGUFReader`` shapes them
(dense types in their dtype, block formats as rows of bytes); decoding the
blocks stays gguf-py's.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUFValueType -> struct format; 8 is a string, 9 an array.
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
# GGML types numpy holds as they are; the rest (bf16 and the block formats) stay bytes.
_NUMPY = {"F32": np.float32, "F16": np.float16, "F64": np.float64,
          "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}  # fmt: skip


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor of the file (the fields of gguf-py's ``ReaderTensor`` we use)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # ggml's order: the innermost dimension first
    n_bytes: int
    data: np.ndarray


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader understands."""


def read_gguf(path: str | Path) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    """The file's metadata (key -> value; arrays as lists) and its tensors by name."""
    import gguf

    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if buf[:4] != MAGIC:
        raise GGUFFormatError("it does not start with the GGUF magic bytes")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise GGUFFormatError(f"GGUF version {version} (big-endian, or not 2/3) is not supported")
    reader = _Cursor(buf, 24)
    metadata = {}
    for _ in range(n_kv):
        key = reader.string()
        metadata[key] = reader.value(reader.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = reader.string()
        dims = struct.unpack_from(f"<{reader.scalar('<I')}Q", buf, reader.pos)
        reader.pos += 8 * len(dims)
        kind, offset = struct.unpack_from("<IQ", buf, reader.pos)
        reader.pos += 12
        infos.append((name, dims, gguf.GGMLQuantizationType(kind), offset))
    align = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-reader.pos // align) * align
    whole = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {}
    for name, dims, kind, offset in infos:
        block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        n_bytes = int(np.prod(dims, dtype=np.int64)) // block * block_bytes
        raw = whole[start + offset : start + offset + n_bytes]
        if len(raw) != n_bytes:
            raise GGUFFormatError(f"tensor {name} runs past the end of the file (truncated?)")
        rows = tuple(int(d) for d in reversed(dims))
        if kind.name in _NUMPY:
            data = raw.view(_NUMPY[kind.name]).reshape(rows)
        else:
            data = raw.reshape(*rows[:-1], rows[-1] // block * block_bytes)
        tensors[name] = GGUFTensor(name, kind, tuple(int(d) for d in dims), n_bytes, data)
    return metadata, tensors


class _Cursor:
    """Reads values one after another from the header."""

    def __init__(self, buf: mmap.mmap, pos: int) -> None:
        self.buf, self.pos = buf, pos

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        self.pos += n
        return self.buf[self.pos - n : self.pos].decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item in _SCALARS and item != 7:  # numbers: one numpy read
                dtype = np.dtype(_SCALARS[item].replace("<?", "?"))
                values = np.frombuffer(self.buf, dtype, count, self.pos)
                self.pos += dtype.itemsize * count
                return values.tolist()
            return [self.value(item) for _ in range(count)]
        if kind not in _SCALARS:
            raise GGUFFormatError(f"unknown metadata value type {kind}")
        return self.scalar(_SCALARS[kind])
