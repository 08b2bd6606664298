"""A decoder layer's elementwise work in three kernels: RMSNorm (with the
residual add before it), RoPE on q and k, SiLU(gate) * up.

Eager PyTorch runs these as ~30 kernels per layer (each RMSNorm 8: cast,
pow, mean, add, rsqrt, mul, cast, mul; RoPE 10; SiLU-mul 2; residual adds
2). Inside a decode graph each still costs a launch and a pass over its
tensor; at one stream of an 8B model on an H200 they were the gap between
the step and the weight read. vLLM runs the same three fusions when it does
not compile (``fused_add_rms_norm``, ``rotary_embedding``, ``silu_and_mul``).

Each kernel rounds where the eager ops round (a bfloat16 product is rounded
before it is added, as ``q * cos + rotate_half(q) * sin`` does), so outputs
match the eager path to the last bit or within one rounding of the float32
sums; ``tests/triton/test_layer_ops.py`` checks them against the models' own
``RMSNorm``, ``apply_rope`` and ``GatedMLP``. A model uses them through
``paged_server.models.layers.use_layer_ops`` (the Triton backend's
``layer_ops`` on CUDA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from paged_triton.interpreter_bf16 import cast
from paged_triton.launch import Launch
from paged_triton.launch_checks import interpreted


@triton.jit
def _rms_norm_kernel(
    X,
    DELTA,
    W,
    OUT,
    SUM,
    heads,
    stride_xt,
    stride_xh,
    stride_dt,
    stride_ot,
    stride_oh,
    stride_st,
    n,
    eps,
    HAS_DELTA: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    BLOCK: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    # One row per program: token t, head h (heads == 1 for a hidden-state norm).
    row = tl.program_id(0)
    t = (row // heads).to(tl.int64)
    h = (row % heads).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(X + t * stride_xt + h * stride_xh + cols, mask=mask, other=0.0)
    if HAS_DELTA:  # residual + delta, rounded as the eager add rounds, kept as the new residual
        d = tl.load(DELTA + t * stride_dt + cols, mask=mask, other=0.0)
        x = cast(x.to(tl.float32) + d.to(tl.float32), SUM.dtype.element_ty, EMULATE_BF16)
        tl.store(SUM + t * stride_st + cols, x, mask=mask)
    x = x.to(tl.float32)
    x = x * tl.math.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:  # Gemma: x * (1 + w) in float32, then cast
        y = x * (1.0 + w)
    else:  # Llama, Qwen: cast, then times w
        y = cast(x, OUT.dtype.element_ty, EMULATE_BF16).to(tl.float32) * w
    tl.store(OUT + t * stride_ot + h * stride_oh + cols, cast(y, OUT.dtype.element_ty, EMULATE_BF16), mask=mask)


def rms_norm(x: Tensor, weight: Tensor, eps: float, unit_offset: bool = False) -> Tensor:
    """``RMSNorm`` over the last dim of ``x`` (``[tokens, n]``, or
    ``[tokens, heads, n]`` with any token and head strides: q and k as views
    of the fused q/k/v projection); a new contiguous tensor."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _norm(x, None, weight, eps, unit_offset, out, None)
    return out


def add_rms_norm(
    x: Tensor, delta: Tensor, weight: Tensor, eps: float, unit_offset: bool = False
) -> tuple[Tensor, Tensor]:
    """``s = x + delta; (RMSNorm(s), s)`` in one pass over ``[tokens, n]``."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _norm(x, delta, weight, eps, unit_offset, out, total)
    return out, total


def _norm(
    x: Tensor, delta: Tensor | None, weight: Tensor, eps: float, unit_offset: bool, out: Tensor,
    total: Tensor | None,
) -> None:  # fmt: skip
    if x.stride(-1) != 1 or (delta is not None and (delta.dim() != 2 or delta.stride(-1) != 1)):
        raise ValueError("rms_norm needs the last dim contiguous (and a 2-D delta)")
    if x.numel():
        plan_rms_norm(x, delta, weight, eps, unit_offset, out, total).run()


def plan_rms_norm(
    x: Tensor, delta: Tensor | None, weight: Tensor, eps: float, unit_offset: bool, out: Tensor,
    total: Tensor | None,
) -> Launch:  # fmt: skip
    """One program per row (token, or token and head of ``[tokens, heads, n]``)."""
    n = x.shape[-1]
    rows3 = x if x.dim() == 3 else x.unsqueeze(1)
    out3 = out if out.dim() == 3 else out.unsqueeze(1)
    tokens, heads = rows3.shape[0], rows3.shape[1]
    with_delta = delta is not None and total is not None
    if delta is not None and total is not None:
        added, summed, stride_d, stride_s = delta, total, delta.stride(0), total.stride(0)
    else:  # no residual add: the kernel never reads these
        added, summed, stride_d, stride_s = x, out, 0, 0
    return Launch(
        _rms_norm_kernel,
        (tokens * heads,),
        (x, added, weight, out, summed, heads, rows3.stride(0), rows3.stride(1), stride_d,
         out3.stride(0), out3.stride(1), stride_s, n, eps),
        dict(HAS_DELTA=with_delta, UNIT_OFFSET=unit_offset, BLOCK=triton.next_power_of_2(n),
             EMULATE_BF16=_emulate(x)),
        num_warps=4 if n <= 1024 else 8,
        num_stages=1,
    )  # fmt: skip


# Ints taken in both branches of the q/k choice: never specialised, so the
# branches' values have one type whatever they are (a kv head count of 1).
ROPE_INTS = ["q_heads", "k_heads", "stride_qt", "stride_qh", "stride_kt", "stride_kh"]


@triton.jit(do_not_specialize=ROPE_INTS)
def _rope_kernel(
    Q,
    K,
    COS,
    SIN,
    q_heads,
    k_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ct,
    half,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    # Program (t, 0) rotates token t's q heads in place, (t, 1) its k heads:
    # x * cos + rotate_half(x) * sin.
    t = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 0:
        X, heads, stride_xt, stride_xh = Q, q_heads, stride_qt, stride_qh
    else:
        X, heads, stride_xt, stride_xh = K, k_heads, stride_kt, stride_kh
    hs = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    mask = (hs < heads)[:, None] & (d < half)[None, :]
    first = X + t * stride_xt + hs[:, None].to(tl.int64) * stride_xh + d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + half, mask=mask, other=0.0)
    c1 = tl.load(COS + t * stride_ct + d, mask=d < half, other=0.0)[None, :]
    c2 = tl.load(COS + t * stride_ct + half + d, mask=d < half, other=0.0)[None, :]
    s1 = tl.load(SIN + t * stride_ct + d, mask=d < half, other=0.0)[None, :]
    s2 = tl.load(SIN + t * stride_ct + half + d, mask=d < half, other=0.0)[None, :]
    dt = Q.dtype.element_ty
    lo = _rounded(x1, c1, dt, EMULATE_BF16) - _rounded(x2, s1, dt, EMULATE_BF16)
    hi = _rounded(x2, c2, dt, EMULATE_BF16) + _rounded(x1, s2, dt, EMULATE_BF16)
    tl.store(first, cast(lo, dt, EMULATE_BF16), mask=mask)
    tl.store(first + half, cast(hi, dt, EMULATE_BF16), mask=mask)


@triton.jit
def _rounded(a, b, dtype: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """``a * b`` rounded to ``dtype`` (as the eager product is), back in float32."""
    return cast(a.to(tl.float32) * b.to(tl.float32), dtype, EMULATE_BF16).to(tl.float32)


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """``apply_rope`` on ``q [tokens, heads, d]`` and ``k [tokens, kv_heads, d]``
    in place (any token and head strides, ``d`` contiguous); ``cos``/``sin``
    ``[tokens, d]`` in their dtype, as ``RotaryEmbedding`` returns them."""
    tokens, d = q.shape[0], q.shape[-1]
    if cos.shape != (tokens, d) or sin.shape != cos.shape or cos.stride() != sin.stride():
        raise ValueError(f"rope needs cos/sin [{tokens}, {d}], got {tuple(cos.shape)}")
    if d % 2 or q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1:
        raise ValueError("rope needs an even head_dim with its last dim contiguous")
    if q.dtype != k.dtype or k.shape[0] != tokens or k.shape[-1] != d:
        raise ValueError(f"rope needs q and k alike but for heads: {tuple(q.shape)}, {tuple(k.shape)}")
    if tokens:
        plan_rope(q, k, cos, sin).run()
    return q, k


def plan_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> Launch:
    """Programs (token, q or k)."""
    d = q.shape[-1]
    return Launch(
        _rope_kernel,
        (q.shape[0], 2),
        (q, k, cos, sin, q.shape[1], k.shape[1], q.stride(0), q.stride(1), k.stride(0),
         k.stride(1), cos.stride(0), d // 2),
        dict(BLOCK_H=triton.next_power_of_2(max(q.shape[1], k.shape[1])),
             BLOCK_HALF=triton.next_power_of_2(d // 2), EMULATE_BF16=_emulate(q)),
        num_warps=4,
        num_stages=1,
    )  # fmt: skip


@triton.jit
def _silu_mul_kernel(
    GATE_UP,
    OUT,
    n,
    stride_gt,
    stride_ot,
    BLOCK: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(GATE_UP + t * stride_gt + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GATE_UP + t * stride_gt + n + cols, mask=mask, other=0.0).to(tl.float32)
    dt = OUT.dtype.element_ty
    act = cast(gate / (1.0 + tl.exp(-gate)), dt, EMULATE_BF16).to(tl.float32)  # silu, rounded
    tl.store(OUT + t * stride_ot + cols, cast(act * up, dt, EMULATE_BF16), mask=mask)


SILU_BLOCK = 1024  # features per program


def silu_mul(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` for ``gate_up [tokens, 2n]`` (gate first, as
    ``GatedMLP``'s fused projection stacks them); ``[tokens, n]``."""
    tokens, n = gate_up.shape[0], gate_up.shape[-1] // 2
    if gate_up.dim() != 2 or gate_up.shape[-1] % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"silu_mul needs [tokens, 2n] with the last dim contiguous, got {tuple(gate_up.shape)}")
    out = torch.empty(tokens, n, dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        plan_silu_mul(gate_up, out).run()
    return out


def plan_silu_mul(gate_up: Tensor, out: Tensor) -> Launch:
    """Programs (token, block of ``SILU_BLOCK`` features)."""
    n = out.shape[-1]
    block = min(SILU_BLOCK, triton.next_power_of_2(n))
    return Launch(
        _silu_mul_kernel,
        (out.shape[0], triton.cdiv(n, block)),
        (gate_up, out, n, gate_up.stride(0), out.stride(0)),
        dict(BLOCK=block, EMULATE_BF16=_emulate(gate_up)),
        num_warps=4,
        num_stages=1,
    )


def _emulate(x: Tensor) -> bool:
    """Round bfloat16 as a GPU does when the interpreter runs the kernels."""
    return interpreted(_rms_norm_kernel) and x.dtype == torch.bfloat16
