"""The CPU's C-kernel attention backend: ``CpuDecodeOps`` plus a fused path.

Where the C kernels apply (``cpu_decode``), a decode-only layer's write
and attention are one call (``write_and_decode``), and so is a short
prompt chunk, each row a decode of its own, where that costs less than a
prefill (``CpuDecodeOps.prefill_as_decodes``: the most keys read in all).
In any other step with decodes that call writes every row and attends the
decodes, and the prefill op attends the prompt chunks. Everything else
runs the reference ops (``OpsBackend``).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from paged_ref.attention_metadata import AttentionMetadata
from paged_ref.cpu.cpu_decode import CpuDecodeOps
from paged_ref.ops_backend import OpsBackend, rows_of


class CpuKernelsBackend(OpsBackend):
    """The C kernels as an ``AttentionBackend`` (see module doc): what a
    compiled CPU pass over the reference runs (``RefBackend.compiled_variant``)."""

    name = "cpu"
    device_types: tuple[str, ...] = ("cpu",)
    compilable = True

    def __init__(self, ops: Any = None) -> None:
        super().__init__(CpuDecodeOps() if ops is None else ops)

    def attend(
        self, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, q: Tensor, k: Tensor,
        v: Tensor, *, scale: float, sliding_window: int | None, softcap: float | None,
        scales: dict[str, Tensor],
    ) -> Tensor:  # fmt: skip
        """The fused write-and-decode where it applies (unscaled caches), else
        ``OpsBackend``'s ops; ``write_and_decode`` answers None where its
        kernels do not take the tensors, and then nothing was written."""
        if scales:
            return super().attend(k_cache, v_cache, meta, q, k, v, scale=scale,
                                  sliding_window=sliding_window, softcap=softcap, scales=scales)  # fmt: skip
        fused, dec, pre = self.ops.write_and_decode, meta.decode, meta.prefill
        rows = dec if pre is None and dec is not None and dec.rows is None else None  # decodes only
        if rows is None and pre is not None and meta.prefill_key_reads() <= self.ops.prefill_as_decodes:
            rows = meta.as_decodes()
        decoded = None
        if rows is not None:
            out = fused(
                k_cache, v_cache, q, k, v, meta.slot_mapping, rows.block_tables, rows.seq_lens,
                scale, sliding_window, softcap, meta.memo,
            )  # fmt: skip
            if out is not None:
                return out  # type: ignore[no-any-return]
        elif dec is not None:
            decoded = fused(
                k_cache, v_cache, rows_of(q, dec, dec.seq_lens.shape[0]), k, v, meta.slot_mapping,
                dec.block_tables, dec.seq_lens, scale, sliding_window, softcap, meta.memo,
            )  # fmt: skip
        if decoded is None:
            self.ops.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        return self.attend_parts(k_cache, v_cache, meta, q, scale, sliding_window, softcap, scales, decoded)
