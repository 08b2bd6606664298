"""A GGUF file's tensors under Hugging Face names, decoded for our loader.

f32/f16/bf16 tensors come as they are. Q8_0 (blocks of 32 int8 values and
an f16 scale) and Q4_0 (blocks of 32 4-bit codes, an f16 scale, zero point
8) are exactly our int8 / int4 weights in groups of 32 (``QuantizedWeight``),
so linear layers keep them and run the int8/int4 kernels. The other block
formats gguf-py can decode (Q4_1, Q5_*, the K-quants; llama.cpp's Q4_0
files keep the LM head in Q6_K) are dequantized, and a log line says so;
the rest are refused by name. llama.cpp's converter permutes Llama's q/k
rows for its RoPE layout: ``unpermute_rows`` undoes that exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from paged_server.models.errors import CheckpointMismatchError
from paged_server.models.quantization.weights import QuantizedWeight

if TYPE_CHECKING:
    from paged_server.models.gguf import GGUFFile

log = logging.getLogger(__name__)

DENSE_TYPES = ("F32", "F16", "BF16")
MAPPED_TYPES = {"Q8_0": 8, "Q4_0": 4}  # -> QuantizedWeight bits, groups of 32
DEQUANTIZED_TYPES = ("Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
BLOCK = 32
# Architectures whose q/k rows llama.cpp's converter permutes (LlamaModel.undo_permute).
PERMUTED_QK = ("llama",)


def check_types(file: GGUFFile) -> None:
    """Refuse a file holding a tensor type we cannot load, naming it."""
    for name, tensor in file.tensors.items():
        kind = tensor.tensor_type.name
        if kind not in (*DENSE_TYPES, *MAPPED_TYPES, *DEQUANTIZED_TYPES):
            raise CheckpointMismatchError(
                f"{file.path.name}: tensor {name} is {kind}, which paged-server cannot load; "
                f"supported: {', '.join(DENSE_TYPES)}, Q8_0 and Q4_0 (int8/int4 kernels), "
                f"{', '.join(DEQUANTIZED_TYPES)} (dequantized): convert the model to one of these"
            )


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes the converter's ``permute`` (each head's
    rows interleaved in pairs) : ``hf = gguf[unpermute_rows(...)]``."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


class GGUFTensors:
    """The file's tensors named as the Hugging Face checkpoint named them,
    read the way ``safe_open`` reads a safetensors file (``keys``,
    ``get_tensor``, ``get_slice``), so ``loader.load_weights`` loads them;
    ``quantized`` gives Q8_0/Q4_0 weights as they are."""

    def __init__(self, file: GGUFFile, hf_names: Iterable[str], heads: int, kv_heads: int) -> None:
        import gguf

        arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[file.arch]
        table = gguf.get_tensor_name_map(arch, int(file.arch_value("block_count")))
        self.file = file
        self.gguf_name: dict[str, str] = {}
        for name in hf_names:
            found = table.get_name(name, try_suffixes=(".weight", ".bias"))
            if found in file.tensors:
                self.gguf_name[name] = found
        self.permuted: dict[str, int] = {}
        if file.arch in PERMUTED_QK:
            for name in self.gguf_name:
                if name.endswith(("q_proj.weight", "q_proj.bias")):
                    self.permuted[name] = heads
                elif name.endswith(("k_proj.weight", "k_proj.bias")):
                    self.permuted[name] = kv_heads
        self.dequantized: dict[str, str] = {}  # gguf name -> type, for the log line

    def __enter__(self) -> GGUFTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def keys(self) -> list[str]:
        """Every Hugging Face name the file has a tensor for."""
        return list(self.gguf_name)

    def type_of(self, name: str) -> str:
        """The GGML type name (``Q8_0``) of the tensor Hugging Face calls ``name``."""
        return self.file.tensors[self.gguf_name[name]].tensor_type.name

    def nbytes(self, name: str) -> int:
        """Bytes the tensor takes in the file."""
        return int(self.file.tensors[self.gguf_name[name]].n_bytes)

    def get_tensor(self, name: str) -> torch.Tensor:
        """The tensor, dense: in its own dtype, or dequantized to float32."""
        tensor = self.file.tensors[self.gguf_name[name]]
        dense = _dense(tensor)
        if tensor.tensor_type.name not in DENSE_TYPES:
            self.dequantized[tensor.name] = tensor.tensor_type.name
        if name in self.permuted:
            dense = dense[unpermute_rows(dense.shape[0], self.permuted[name])]
        return dense

    def get_slice(self, name: str) -> _Slice:
        return _Slice(self, name)

    def quantized(self, name: str) -> QuantizedWeight | None:
        """A Q8_0 / Q4_0 weight as a ``QuantizedWeight`` (int8 or int4 in
        groups of 32, the block's f16 scale), else None."""
        tensor = self.file.tensors[self.gguf_name[name]]
        bits = MAPPED_TYPES.get(tensor.tensor_type.name)
        if bits is None or len(tensor.data.shape) != 2:
            return None
        weight = _q8_0(tensor.data) if bits == 8 else _q4_0(tensor.data)
        if name in self.permuted:
            rows = unpermute_rows(weight.shape[0], self.permuted[name])
            weight = QuantizedWeight(weight.qweight[rows], weight.scales[rows], None, bits, BLOCK)
        return weight

    def log_dequantized(self) -> None:
        """One line naming the tensors that were dequantized, and why."""
        if not self.dequantized:
            return
        kinds = sorted(set(self.dequantized.values()))
        names = sorted(self.dequantized)
        log.info(
            "GGUF: %d tensors (%s) dequantized to dense weights: %s%s (embeddings and the LM head "
            "stay dense, as vLLM's; Q8_0/Q4_0 linear layers keep int8/int4 kernels)",
            len(names), ", ".join(kinds), ", ".join(names[:4]), " ..." if len(names) > 4 else "",
        )  # fmt: skip


class _Slice:
    """``safe_open``'s slice object: the shape, and indexing into the tensor."""

    def __init__(self, tensors: GGUFTensors, name: str) -> None:
        self.tensors, self.name = tensors, name

    def get_shape(self) -> list[int]:
        tensor = self.tensors.file.tensors[self.tensors.gguf_name[self.name]]
        return [int(d) for d in reversed(tensor.shape)]  # ggml lists dims innermost first

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.tensors.get_tensor(self.name)[index]


def _dense(tensor: Any) -> torch.Tensor:
    """A reader tensor as torch: copied out of the memory map in its own
    dtype (bf16 arrives as bytes), or dequantized by gguf-py."""
    kind = tensor.tensor_type.name
    data = np.asarray(tensor.data)
    if kind in ("F32", "F16"):
        return torch.from_numpy(data.copy())
    if kind == "BF16":
        return torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16)
    import gguf

    return torch.from_numpy(gguf.quants.dequantize(data, tensor.tensor_type).astype(np.float32))


def _blocks(data: np.ndarray, block_bytes: int) -> tuple[np.ndarray, torch.Tensor]:
    """Rows of blocks ``[N, K / 32, block_bytes]`` and their f16 scales as float32."""
    rows = data.shape[0]
    blocks = np.asarray(data).reshape(rows, -1, block_bytes)
    scales = blocks[..., :2].copy().view(np.float16).reshape(rows, -1)
    return blocks, torch.from_numpy(scales.astype(np.float32))


def _q8_0(data: np.ndarray) -> QuantizedWeight:
    blocks, scales = _blocks(data, 2 + BLOCK)
    q = blocks[..., 2:].copy().view(np.int8).reshape(blocks.shape[0], -1)
    return QuantizedWeight(torch.from_numpy(q), scales, None, 8, BLOCK)


def _q4_0(data: np.ndarray) -> QuantizedWeight:
    # A block's 16 bytes hold values 0-15 in their low nibbles, 16-31 in the high ones.
    blocks, scales = _blocks(data, 2 + BLOCK // 2)
    packed = blocks[..., 2:]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.int8) - 8
    q = torch.from_numpy(codes.reshape(blocks.shape[0], -1))
    return QuantizedWeight(q, scales, None, 4, BLOCK)
