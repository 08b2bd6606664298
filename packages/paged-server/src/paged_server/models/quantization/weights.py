"""One in-memory form for every quantized weight format, whatever the checkpoint.

Each format's reader (compressed-tensors, GPTQ, AWQ, online quantization)
turns its tensors into a ``QuantizedWeight``: the integer (or fp8) values
laid out like the dense weight, ``[out_features, in_features]``, with one
scale (and zero point) per output row and group of ``group_size`` input
features. ``w = (q - zero) * scale``. Tensor parallelism slices this form,
so scales are always sharded with their weights, and ``QuantizedLinear``
packs it once for the kernel of the device it runs on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from paged_server.models.errors import CheckpointMismatchError


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """``qweight [N, K]``: int8 holding signed ``bits``-bit values
    (``-2**(bits-1) .. 2**(bits-1)-1``), or float8_e4m3fn; ``scales
    [N, K // group_size]`` float32; ``zeros`` like ``scales`` (signed, int8)
    for asymmetric formats, ``None`` for symmetric ones."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    group_size: int
    fp8: bool = False

    def __post_init__(self) -> None:
        n, k = self.qweight.shape
        if self.group_size <= 0 or k % self.group_size:
            raise CheckpointMismatchError(
                f"quantized weight {(n, k)} has {k} input features, which groups of "
                f"{self.group_size} do not divide; the checkpoint's scales do not fit its weights"
            )
        if self.scales.shape != (n, k // self.group_size):
            raise CheckpointMismatchError(
                f"quantized weight {(n, k)} with group size {self.group_size} needs scales of "
                f"shape {(n, k // self.group_size)}, got {tuple(self.scales.shape)}; the "
                "checkpoint's scales do not fit its weights"
            )
        if self.zeros is not None and self.zeros.shape != self.scales.shape:
            raise CheckpointMismatchError(
                f"quantized weight {(n, k)} has scales of shape {tuple(self.scales.shape)} but "
                f"zero points of shape {tuple(self.zeros.shape)}; the checkpoint's zero points "
                "do not fit its weights"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)  # type: ignore[return-value]

    @property
    def format(self) -> str:
        """Short name for logs: ``int4 g128 asym``, ``int8 per-channel``, ``fp8``."""
        if self.fp8:
            return "fp8_e4m3"
        groups = "per-channel" if self.group_size == self.shape[1] else f"g{self.group_size}"
        return f"int{self.bits} {groups}{' asym' if self.zeros is not None else ''}"

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense ``[N, K]`` weight in ``dtype`` (fallback kernels, tests)."""
        q = self.qweight.to(torch.float32)
        if self.zeros is not None:
            q = q - self.zeros.to(torch.float32).repeat_interleave(self.group_size, dim=1)
        return (q * self.scales.repeat_interleave(self.group_size, dim=1)).to(dtype)

    def shard(self, dim: int, start: int, size: int) -> QuantizedWeight:
        """Rows (``dim=0``) or input features (``dim=1``) ``[start, start+size)``,
        with their scales; input slices must fall on group boundaries."""
        if dim == 0:
            rows = slice(start, start + size)
            return replace(
                self,
                qweight=self.qweight[rows].contiguous(),
                scales=self.scales[rows].contiguous(),
                zeros=None if self.zeros is None else self.zeros[rows].contiguous(),
            )
        g, k = self.group_size, self.shape[1]
        if g == k:  # per-channel: every rank keeps the whole scale row
            return replace(
                self, qweight=self.qweight[:, start : start + size].contiguous(), group_size=size
            )
        if start % g or size % g:
            raise CheckpointMismatchError(
                f"tensor parallelism splits {k} input features into slices of {size}, which "
                f"cut quantization groups of {g}; choose a tensor_parallel_size whose slices "
                f"are multiples of {g}"
            )
        groups = slice(start // g, (start + size) // g)
        return replace(
            self,
            qweight=self.qweight[:, start : start + size].contiguous(),
            scales=self.scales[:, groups].contiguous(),
            zeros=None if self.zeros is None else self.zeros[:, groups].contiguous(),
        )

    def to_group_size(self, group_size: int) -> QuantizedWeight:
        """The same values with scales repeated for a finer ``group_size``
        (a divisor of the current one): what a kernel with fixed groups needs."""
        if group_size == self.group_size:
            return self
        repeat = self.group_size // group_size
        assert repeat * group_size == self.group_size, (self.group_size, group_size)
        return replace(
            self,
            scales=self.scales.repeat_interleave(repeat, dim=1),
            zeros=None if self.zeros is None else self.zeros.repeat_interleave(repeat, dim=1),
            group_size=group_size,
        )


def require(t: dict[str, torch.Tensor], name: str, fmt: str, *suffixes: str) -> None:
    """Refuse a layer of format ``fmt`` that lacks one of the tensors it needs."""
    for suffix in suffixes:
        if suffix not in t:
            raise CheckpointMismatchError(
                f"{name}.{suffix} is missing: {fmt} layers need {', '.join(suffixes)}; the "
                "checkpoint is incomplete, or not in the format its quantization_config says"
            )


def group_size_of(tensor: str, groups: int, in_features: int) -> int:
    """The group size ``groups`` scales per output feature give a weight of
    ``in_features``, or a refusal naming the scales ``tensor``."""
    if groups <= 0 or in_features % groups:
        raise CheckpointMismatchError(
            f"{tensor} has {groups} groups per output feature, which do not divide the weight's "
            f"{in_features} input features; the checkpoint's scales do not fit its weights"
        )
    return in_features // groups


def finite_scales(scales: torch.Tensor, tensor: str) -> torch.Tensor:
    """``scales`` in float32, refused if any is NaN or infinite (every
    request through the layer would fail)."""
    scales = scales.to(torch.float32)
    if not bool(torch.isfinite(scales).all()):
        raise CheckpointMismatchError(
            f"{tensor} holds NaN or infinite values; the checkpoint is damaged: re-export it"
        )
    return scales


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights along output rows (a fused q/k/v or gate/up projection);
    they must share bits, group size and symmetry."""
    first = parts[0]
    for p in parts[1:]:
        if (p.bits, p.group_size, p.fp8, p.zeros is None) != (
            first.bits, first.group_size, first.fp8, first.zeros is None
        ):  # fmt: skip
            raise CheckpointMismatchError(
                f"cannot fuse projections quantized differently ({first.format} and {p.format})"
            )
    zeros = None if first.zeros is None else torch.cat([p.zeros for p in parts])  # type: ignore[misc]
    return replace(
        first,
        qweight=torch.cat([p.qweight for p in parts]),
        scales=torch.cat([p.scales for p in parts]),
        zeros=zeros,
    )


def quantize_int(weight: torch.Tensor, bits: int, group_size: int | None) -> QuantizedWeight:
    """Symmetric round-to-nearest quantization of a dense ``[N, K]`` weight:
    per output channel (``group_size=None``) or per group of input features.
    The scale maps the group's largest magnitude to ``2**(bits-1) - 1``."""
    n, k = weight.shape
    g = k if group_size is None else group_size
    if k % g:
        raise ValueError(f"in_features {k} is not a multiple of the quantization group size {g}")
    qmax = 2 ** (bits - 1) - 1
    w = weight.detach().to(torch.float32).reshape(n, k // g, g)
    scales = (w.abs().amax(-1) / qmax).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scales[..., None]).clamp(-qmax - 1, qmax).to(torch.int8)
    return QuantizedWeight(q.reshape(n, k), scales, None, bits, g)


def quantize_fp8(weight: torch.Tensor) -> QuantizedWeight:
    """vLLM's online fp8: float8_e4m3fn values, one scale for the whole tensor
    (stored per row, all equal), so the largest magnitude maps to 448."""
    w = weight.detach().to(torch.float32)
    scale = (w.abs().amax() / torch.finfo(torch.float8_e4m3fn).max).clamp(min=1e-12)
    q = (w / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    scales = scale.expand(w.shape[0], 1).contiguous()
    return QuantizedWeight(q, scales, None, 8, w.shape[1], fp8=True)
