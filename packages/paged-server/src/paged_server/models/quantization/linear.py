"""``QuantizedLinear``: a linear layer whose weight stays quantized in memory.

On CPU, weight-only int8 (per-channel; grouped int8 as one product per
group, summed) and int4 (groups of 32-256) run
torch's own packed kernels, ``aten._weight_int8pack_mm`` and
``aten._weight_int4pack_mm_for_cpu`` (the ones torchao's CPU layouts call),
with activations in bfloat16 (they read 2x/4x fewer bytes than fp32; their
float32-activation paths are far slower). In the compiled forward pass
(engine/worker/compiled_forward.py) inductor lowers both to its C++ GEMM
template, which keeps the weight quantized. A single row (one stream's
decode step) runs ``cpu_gemv`` where the CPU has AVX512 VNNI: the row
rounded to int8, as vLLM's CPU AWQ/GPTQ path. docs/cpu.md has the
measurements behind each choice. On CUDA, int8 and int4 weights
run ``paged_triton``'s dequantizing GEMM (``quant_matmul``: the weight
dequantized tile by tile in registers, split-K for decode), reading the layout kept below for
dequantize-per-call; from ``DENSE_ROWS`` rows (prefill) they dequantize
the weight in one Triton pass into a temporary dense buffer and let cuBLAS
multiply, which is faster there. Everything else (fp8, int8 with zero points on CPU,
group sizes neither kernel takes, shapes aten's kernels cannot run: see
``_INT8_K_MULTIPLE``) dequantizes the weight per matmul: memory stays
quantized, the arithmetic is the dense one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_server.models.quantization import cpu_gemv
from paged_server.models.quantization.weights import QuantizedWeight
from paged_server.models.tensor_parallel import SINGLE, TensorParallel

_INT4_GROUPS = (256, 128, 64, 32)  # what the CPU int4 kernel accepts
# aten's int8 kernel reads 16 input features per vector with no tail and no
# check: other widths read past the row (a segfault from 2 rows, garbage at
# 1); its int4 packing takes output rows 16 at a time (a RuntimeError else).
_INT8_K_MULTIPLE = 16
_INT4_N_MULTIPLE = 16
_ACT_DTYPE = torch.bfloat16  # the CPU kernels' fast activation dtype


PACKED_CPU_KERNELS = ("int8pack_mm", "int8pack_mm_grouped", "int4pack_mm")


def uses_packed_cpu_kernels(model: nn.Module) -> bool:
    """Whether any layer of ``model`` runs aten's packed int8/int4 CPU
    kernels (what the compiled forward lowers to inductor's GEMM template)."""
    return any(
        isinstance(m, QuantizedLinear) and m.kernel in PACKED_CPU_KERNELS for m in model.modules()
    )


def _cpu_kernels() -> bool:
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int8pack_mm") and hasattr(ops, "_weight_int4pack_mm_for_cpu")


class QuantizedLinear(nn.Module):
    """``y = x @ dequant(w).T + b``; ``kernel`` says which path runs.
    Keeps the tensor-parallel slice it holds (``shard_dim`` etc.) so the
    loader still slices its bias, and sums partial results when it is
    row-parallel."""

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: torch.Tensor | None,
        device: torch.device,
        *,
        shard: tuple[int, int, int] | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.format = weight.format
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().to(device), requires_grad=False)
        )
        if shard is not None:
            self.shard_dim, self.shard_start, self.full_size = shard
        self.tp = tp  # row-parallel: partial products are summed over ranks
        self.slices: list[Any] | None = None  # stacked projections (models/linear.py's)
        self.kernel = self._pack(weight, device)
        self.one_row = self._one_row_kernel()

    def _pack(self, w: QuantizedWeight, device: torch.device) -> str:
        cpu = device.type == "cpu" and _cpu_kernels()
        n, k = w.shape
        # per channel, the group is all k inputs; in groups, each is one product
        int8 = cpu and not w.fp8 and w.bits == 8 and w.zeros is None
        int8 = int8 and w.group_size % _INT8_K_MULTIPLE == 0
        if int8 and w.group_size == k:
            self.register_buffer("qweight", w.qweight.to(device))
            self.register_buffer("scales", w.scales[:, 0].to(_ACT_DTYPE).to(device))
            return "int8pack_mm"
        if int8:
            # Groups: one per-channel product per group of input features, summed.
            g = w.group_size
            chunks = w.qweight.reshape(n, -1, g).transpose(0, 1).contiguous()  # [groups, N, g]
            self.register_buffer("qweight", chunks.to(device))
            self.register_buffer("scales", w.scales.T.contiguous().to(_ACT_DTYPE).to(device))
            self.group_size = g
            return "int8pack_mm_grouped"
        group = next((g for g in _INT4_GROUPS if w.group_size % g == 0), None)
        if cpu and not w.fp8 and w.bits == 4 and group is not None and n % _INT4_N_MULTIPLE == 0:
            w = w.to_group_size(group)
            # The kernel computes (q_u - 8) * scale + zero with q_u = q + 8 unsigned.
            zero = torch.zeros_like(w.scales) if w.zeros is None else -w.zeros.float() * w.scales
            unsigned = (w.qweight.to(torch.int32) + 8).contiguous()
            self.register_buffer(
                "qweight",
                torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 1).to(device),
            )
            scale_zero = torch.stack([w.scales, zero], dim=-1).transpose(0, 1).contiguous()
            self.register_buffer("scales", scale_zero.to(_ACT_DTYPE).to(device))
            self.group_size = group
            return "int4pack_mm"
        # The CUDA kernel's layout, also the fallback's: the values (4-bit ones two to a
        # byte, code + 8, even input feature in the low nibble; one a byte, as int8,
        # when the inputs are odd) dequantized per call.
        self.group_size, self.bits, self.fp8 = w.group_size, w.bits, w.fp8
        self.nibbles = w.bits == 4 and not w.fp8 and k % 2 == 0
        q = w.qweight
        if self.nibbles:
            u = (q.to(torch.int16) + 8).to(torch.uint8)
            q = u[:, 0::2] | (u[:, 1::2] << 4)
        self.register_buffer("qweight", q.to(device))
        self.register_buffer("scales", w.scales.to(device))
        self.register_buffer("zeros", None if w.zeros is None else w.zeros.to(device))
        if device.type == "cuda" and not w.fp8:
            from paged_triton.quant_matmul import supports  # imports triton: CUDA only

            if supports(w.bits, w.group_size, k) is None:
                return "quant_matmul"
        return "dequantize"

    def _one_row_kernel(self) -> bool:
        """Whether a single row (one stream's decode step) runs ``cpu_gemv``
        instead of aten's kernel: the same buffers, the row rounded to int8."""
        if self.kernel == "int8pack_mm":
            return cpu_gemv.int8_applies(self.in_features)
        if self.kernel == "int4pack_mm":
            return cpu_gemv.int4_applies(self.out_features, self.in_features, self.group_size)
        return False

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense weight this layer multiplies by (the fallback's path)."""
        assert self.kernel in ("dequantize", "quant_matmul"), self.kernel
        q = self.qweight
        if self.nibbles:
            q = torch.stack([q & 0xF, q >> 4], dim=-1).flatten(1).to(torch.int8) - 8
        q = q.to(dtype)
        if self.zeros is not None:
            q = q - self.zeros.to(dtype).repeat_interleave(self.group_size, dim=1)
        return q * self.scales.to(dtype).repeat_interleave(self.group_size, dim=1)

    def forward(self, x: torch.Tensor, lora: object = None) -> torch.Tensor:
        """``x @ W.T`` (+ bias); ``lora`` is unused: ``models.lora.attach``
        refuses a model with quantized layers."""
        if self.kernel == "dequantize":
            out = F.linear(x, self.dequantized_weight(x.dtype))
        elif self.kernel == "quant_matmul":
            from paged_triton import quant_matmul as qm
            from paged_triton.quant_dequantize import dequantize

            w = qm.QuantWeight(self.qweight, self.scales, self.zeros, self.bits, self.group_size)
            if qm.prefers_dense(x.numel() // self.in_features):  # prefill: cuBLAS wins
                out = F.linear(x, dequantize(w, x.dtype))
            else:
                out = qm.quant_matmul(x, w)
        else:
            # bf16 input is not cast, so a strided view (a column slice) arrives as
            # it is, and aten's int4 kernel refuses one: contiguous, no copy otherwise.
            flat = x.reshape(-1, self.in_features).to(_ACT_DTYPE).contiguous()
            if self.one_row and flat.shape[0] == 1:  # decided when a graph is traced
                if self.kernel == "int8pack_mm":
                    y = cpu_gemv.int8_gemv(flat, self.qweight, self.scales)
                else:
                    y = cpu_gemv.int4_gemv(flat, self.qweight, self.scales, self.group_size)
            elif self.kernel == "int8pack_mm":
                y = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales)
            elif self.kernel == "int8pack_mm_grouped":
                parts = flat.split(self.group_size, dim=-1)
                y = sum(
                    torch.ops.aten._weight_int8pack_mm(part, q, s).float()
                    for part, q, s in zip(parts, self.qweight, self.scales, strict=True)
                )
            else:
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                    flat, self.qweight, self.group_size, self.scales
                )
            out = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        if self.tp.world_size > 1:
            out = self.tp.all_reduce(out)
        return out if self.bias is None else out + self.bias

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The output as one tensor per stacked projection (a fused layer's)."""
        assert self.slices is not None, "split() on a layer that stacks no projections"
        return out.split([s.size for s in self.slices], dim=-1)

    def checkpoint_tensors(self, name: str) -> list[tuple[str, Any]]:
        """Where the checkpoint's bias tensors go (models/linear.py's seam; the
        weight is already in): each stacked projection's bias into its rows,
        a column-parallel bias sliced, a row-parallel one whole."""
        from paged_server.models.linear import Part, stacked_parts  # the loader's seam

        if self.bias is None:
            return []
        if self.slices:
            return stacked_parts(name, self.slices, bias=True, params=())
        if getattr(self, "shard_dim", None) == 0:
            part = Part("bias", 0, self.shard_start, self.out_features, self.full_size)
            return [(f"{name}.bias", part)]
        return [(f"{name}.bias", Part("bias"))]

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.format}, kernel={self.kernel}"
