"""An attention backend over an ops module: ``OpsBackend``.

Every backend here runs the four ops of docs/contracts.md ("Attention ops"):
a layer of a step writes its K/V (``write_kv``), attends the decode rows
(``paged_decode_attention``) and the prompt chunks (``paged_prefill_attention``).
``OpsBackend`` is that sequence over any ops namespace; the reference
(``ref_backend``), the C kernels (``cpu.cpu_backend``) and Triton
(``paged_triton.triton_backend``) subclass it with their ops and flags
(``paged_core.attention_backend``), the C kernels also with a fused path.
A bare ops namespace handed to a pool (a test's spy) runs as ``OpsBackend``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from paged_ref.attention_metadata import AttentionMetadata, DecodePart


def rows_of(q: Tensor, dec: DecodePart, num_decodes: int) -> Tensor:
    """The decode rows' queries (a view when they come first)."""
    return q[:num_decodes] if dec.rows is None else q[dec.rows]


class OpsBackend:
    """``paged_core.attention_backend.AttentionBackend`` over ``ops`` (see
    module doc); the flags are the cautious ones: nothing is known of ops
    the backend was not written for."""

    name = "ops"
    device_types: tuple[str, ...] = ("cpu", "cuda")
    auto_for: tuple[str, ...] = ()
    graph_safe = False
    compilable = False
    compiled_variant: str | None = None
    needs_warmup = False
    kv_dtypes: tuple[str, ...] | None = None
    block_sizes: tuple[int, ...] | None = None

    def __init__(self, ops: Any) -> None:
        self._ops = ops

    @classmethod
    def unavailable(cls, device_type: str) -> str | None:
        """Why this backend cannot run on ``device_type``, or None."""
        if device_type in cls.device_types:
            return None
        return (
            f"attention_backend {cls.name!r} runs on {' or '.join(cls.device_types)}, "
            f"not {device_type}; pick another attention_backend or 'auto'"
        )

    @property
    def ops(self) -> Any:
        return self._ops

    def write_kv(self, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor,
                 **scales: Tensor) -> None:  # fmt: skip
        self._ops.write_kv(k_cache, v_cache, k, v, slot_mapping, **scales)

    def copy_blocks(self, k_caches: Tensor, v_caches: Tensor, src_to_dst: Any, **scales: Tensor) -> None:
        self._ops.copy_blocks(k_caches, v_caches, src_to_dst, **scales)

    def attend(
        self, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, q: Tensor, k: Tensor,
        v: Tensor, *, scale: float, sliding_window: int | None, softcap: float | None,
        scales: dict[str, Tensor],
    ) -> Tensor:  # fmt: skip
        """``write_kv``, then the decode and prefill ops (``attend_parts``)."""
        self._ops.write_kv(k_cache, v_cache, k, v, meta.slot_mapping, **scales)
        return self.attend_parts(k_cache, v_cache, meta, q, scale, sliding_window, softcap, scales)

    def attend_parts(
        self, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, q: Tensor, scale: float,
        sliding_window: int | None, softcap: float | None, scales: dict[str, Tensor],
        decoded: Tensor | None = None,
    ) -> Tensor:  # fmt: skip
        """The decode rows and the prompt chunks of a step whose K/V are
        written, each through its op (``decoded``: the decode rows' outputs,
        where the write already attended them), into one ``q``-shaped output."""
        ops, dec, pre = self._ops, meta.decode, meta.prefill
        if pre is None and dec is not None and dec.rows is None and decoded is None:  # decodes only
            return ops.paged_decode_attention(  # type: ignore[no-any-return]
                q, k_cache, v_cache, dec.block_tables, dec.seq_lens, scale,
                sliding_window, softcap, memo=meta.memo, **scales,
            )  # fmt: skip
        num_decodes = 0 if dec is None else dec.seq_lens.shape[0]
        out = torch.empty_like(q)
        if dec is not None:
            o = decoded
            if o is None:
                o = ops.paged_decode_attention(
                    rows_of(q, dec, num_decodes), k_cache, v_cache, dec.block_tables, dec.seq_lens, scale,
                    sliding_window, softcap, memo=meta.memo, **scales,
                )  # fmt: skip
            if dec.rows is None:
                out[:num_decodes] = o
            else:
                out[dec.rows] = o
        if pre is not None:
            q_pre = q[num_decodes:] if pre.rows is None else q[pre.rows]
            o = ops.paged_prefill_attention(
                q_pre, k_cache, v_cache, pre.block_tables, pre.cu_seqlens_q, pre.seq_lens,
                scale, sliding_window, softcap, memo=meta.memo, **scales,
            )  # fmt: skip
            if pre.rows is None:
                out[num_decodes:] = o
            else:
                out[pre.rows] = o
        return out

    def graph_step(self, meta: AttentionMetadata) -> None:
        """What the ops derived from the last step (gather plans, masks) is stale."""
        for group in meta.all_groups():
            group.memo.clear()

    def warm_up(self, layout: Any, device: torch.device) -> Any:
        """Nothing compiles ahead (see ``needs_warmup``)."""
        return None

    def lora_ops(self, device_type: str) -> Any:
        """None: the models' default LoRA kernels (``paged_ref.lora_ops``)."""
        return None

    def layer_ops(self, device_type: str) -> Any:
        """None: the models' eager norms, RoPE and activations."""
        return None
