"""Dense masked attention: the one attention implementation in paged-ref.

The paged ops gather K/V through block tables and the contiguous views read a
contiguous slice; both then call :func:`masked_attention` with a boolean
visibility mask built by :func:`context_mask`, so masking, GQA, soft-capping
and the float32 softmax live in exactly one place.
"""

from __future__ import annotations

import torch
from torch import Tensor


def context_mask(
    q_positions: Tensor,
    kv_lens: Tensor,
    num_keys: int,
    sliding_window: int | None = None,
    q_valid: Tensor | None = None,
) -> Tensor:
    """Which keys each query may see: ``[batch, q_len, num_keys]`` bool.

    ``q_positions`` (``[batch, q_len]``) are absolute token positions;
    ``kv_lens`` (``[batch]``) count the keys stored per sequence. A query at
    position ``t`` sees key ``p`` when ``p <= t``, ``p < kv_len`` and, with a
    window ``w``, ``p > t - w``. ``q_valid`` (``[batch, q_len]``) hides
    padding queries entirely, so their rows come out as zeros.
    """
    device = q_positions.device
    keys = torch.arange(num_keys, device=device).view(1, 1, num_keys)
    pos = q_positions.to(torch.long).unsqueeze(-1)
    mask = (keys <= pos) & (keys < kv_lens.to(torch.long).view(-1, 1, 1))
    if sliding_window is not None:
        mask &= keys > pos - sliding_window
    if q_valid is not None:
        mask &= q_valid.unsqueeze(-1)
    return mask


def masked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor,
    scale: float,
    softcap: float | None = None,
) -> Tensor:
    """Attention of ``q`` over ``k``/``v`` where ``mask`` is True, in float32.

    ``q``: ``[batch, heads, q_len, head_dim]``; ``k``/``v``:
    ``[batch, kv_heads, num_keys, head_dim]`` with ``heads % kv_heads == 0``
    (query head ``h`` reads kv head ``h // (heads // kv_heads)``, as HF's
    ``repeat_kv``); ``mask``: ``[batch, q_len, num_keys]`` bool. GQA/MQA are
    done by viewing the query heads as ``[kv_heads, q_per_kv]`` so K/V are never
    repeated in memory. Soft-capping (``softcap * tanh(s / softcap)``) applies
    to the scaled scores before masking. Rows that see no key are zeros.
    Returns ``[batch, heads, q_len, head_dim]`` in ``q.dtype``.
    """
    batch, heads, q_len, head_dim = q.shape
    kv_heads, num_keys = k.shape[1], k.shape[2]
    if heads % kv_heads != 0:
        raise ValueError(
            f"query heads ({heads}) must be a multiple of kv heads ({kv_heads}) for GQA/MQA"
        )
    q_per_kv = heads // kv_heads
    # [B, H, Lq, D] -> [B, KVH, q_per_kv*Lq, D]: each kv head serves its q_per_kv query heads.
    qf = q.float().reshape(batch, kv_heads, q_per_kv * q_len, head_dim)
    scores = torch.matmul(qf, k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.view(batch, kv_heads, q_per_kv, q_len, num_keys)
    visible = mask.view(batch, 1, 1, q_len, num_keys)
    hidden = ~visible
    # scores and probs are fresh tensors, so they are masked in place.
    scores.masked_fill_(hidden, float("-inf"))
    # Fully masked rows softmax to NaN; zeroing masked entries turns them into 0.
    probs = torch.softmax(scores, dim=-1).masked_fill_(hidden, 0.0)
    # Keys no query sees may be stale rows of a reused block or slot (even NaN);
    # 0 * NaN is NaN, so they are zeroed rather than only given zero weight.
    seen = mask.any(dim=1).view(batch, 1, num_keys, 1)
    vf = v.float().masked_fill(~seen, 0.0)
    out = torch.matmul(probs.view(batch, kv_heads, q_per_kv * q_len, num_keys), vf)
    return out.view(batch, heads, q_len, head_dim).to(q.dtype)
