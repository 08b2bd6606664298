"""The four cache ops' arguments, written once for every backend.

``paged_ref.ops`` defines the ops (docs/contracts.md, "Attention ops");
``paged_triton.ops`` and ``cpu.cpu_decode.CpuDecodeOps`` implement the same
signatures. Each signature is a dataclass here, and an implementation is a
function of one instance of it: :func:`op` makes that the public function,
taking the dataclass's parameters (mypy checks the calls through the
``ParamSpec``; ``inspect.signature`` shows them). A parameter is added in
one place, and every backend has it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass, fields
from typing import Any, ParamSpec, TypeVar

from torch import Tensor

from paged_ref.kv_quant import scale_keywords

P = ParamSpec("P")
A = TypeVar("A")
R = TypeVar("R")


def op(args: Callable[P, A]) -> Callable[[Callable[[A], R]], Callable[P, R]]:
    """``@op(DecodeArgs)`` over ``impl(a: DecodeArgs)``: the public op, called
    with ``DecodeArgs``'s parameters and documented by ``impl``'s docstring."""

    def public(impl: Callable[[A], R]) -> Callable[P, R]:
        @functools.wraps(impl)
        def call(*a: P.args, **kw: P.kwargs) -> R:
            return impl(args(*a, **kw))

        returns = inspect.signature(impl).return_annotation
        call.__signature__ = inspect.signature(args).replace(return_annotation=returns)  # type: ignore[attr-defined]
        return call

    return public


@dataclass(slots=True)
class KVScales:
    """An 8-bit or int4 cache's scales (``kv_quant``, ``kv_int4``): per token
    (int4 keys: per group) in ``k_scales``/``v_scales``, or static per kv
    head (``[kv_heads]`` float32, the layer's) in ``k_head_scales``/
    ``v_head_scales``. All None for a 16/32-bit cache."""

    _: KW_ONLY
    k_scales: Tensor | None = None
    v_scales: Tensor | None = None
    k_head_scales: Tensor | None = None
    v_head_scales: Tensor | None = None

    def scale_keywords(self) -> dict[str, Tensor]:
        """The scales that are set, as keywords (``kv_quant.scale_keywords``)."""
        return scale_keywords(self.k_scales, self.v_scales, self.k_head_scales, self.v_head_scales)

    @property
    def unscaled(self) -> bool:  # (no dict: the CPU decode asks every layer)
        return (self.k_scales is None and self.v_scales is None
                and self.k_head_scales is None and self.v_head_scales is None)  # fmt: skip

    def pass_to(self, fn: Callable[..., R]) -> R:
        """``fn`` (another backend's op) called with these arguments: the
        positional ones in order, keywords only where set, so an ops module
        written before quantized caches still takes a 16-bit cache's call."""
        positional = [getattr(self, f.name) for f in fields(self) if not f.kw_only]
        keywords = {f.name: getattr(self, f.name) for f in fields(self) if f.kw_only}
        return fn(*positional, **{k: v for k, v in keywords.items() if v is not None})


@dataclass(slots=True)
class WriteKVArgs(KVScales):
    """``write_kv``'s: new ``k``/``v`` ``[num_tokens, kv_heads, head_dim]``
    and where each token goes (``slot_mapping``, -1 skips)."""

    k_cache: Tensor
    v_cache: Tensor
    k: Tensor
    v: Tensor
    slot_mapping: Tensor


@dataclass(slots=True)
class AttentionArgs(KVScales):
    """What both attention ops read: queries, one layer's caches, page
    tables, and the caller's per-step ``memo``."""

    q: Tensor
    k_cache: Tensor
    v_cache: Tensor
    block_tables: Tensor
    _: KW_ONLY
    memo: dict[Any, Any] | None = None


@dataclass(slots=True)
class DecodeArgs(AttentionArgs):
    """``paged_decode_attention``'s: one query per sequence."""

    seq_lens: Tensor
    scale: float
    sliding_window: int | None = None
    softcap: float | None = None


@dataclass(slots=True)
class PrefillArgs(AttentionArgs):
    """``paged_prefill_attention``'s: packed query runs, sequence ``b``'s in
    rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``."""

    cu_seqlens_q: Tensor
    seq_lens: Tensor
    scale: float
    sliding_window: int | None = None
    softcap: float | None = None


@dataclass(slots=True)
class CopyBlocksArgs:
    """``copy_blocks``'s: every layer's caches, ``(src, dst)`` block pairs,
    and an int8/int4 cache's per-token scales (static ones are per layer,
    not per block, so they are never copied)."""

    k_caches: Tensor
    v_caches: Tensor
    src_to_dst: Tensor | Sequence[Sequence[int]]
    _: KW_ONLY
    k_scales: Tensor | None = None
    v_scales: Tensor | None = None
