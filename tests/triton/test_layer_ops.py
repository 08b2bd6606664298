"""paged_triton.layer_ops against the models' own eager modules: RMSNorm
(with and without the residual add, Gemma's unit offset, per-head q/k norms
on strided views), RoPE in place on q/k views of the fused projection, and
SiLU(gate) * up. Random shapes, odd sizes included; in the interpreter on a
CPU (bfloat16 rounded as a GPU rounds), on the GPU with one."""

from __future__ import annotations

import pytest
import torch

from paged_server.models.layers import GatedMLP, RMSNorm
from paged_server.models.rope import apply_rope
from paged_triton import layer_ops

from .conftest import DEVICE

pytestmark = pytest.mark.usefixtures("no_grad")


@pytest.fixture
def no_grad():  # type: ignore[no-untyped-def]
    with torch.no_grad():
        yield

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# float32: summation order only. 16-bit: the eager path and the kernel round at
# the same points; a float32 sum taken in another order can still land on the
# other side of a rounding boundary, one ulp (2**-7 relative for bfloat16).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    if dtype != torch.float32:  # rounding at the same points: nearly every element is bit-identical
        same = (got == want).float().mean().item()
        assert same > 0.97, same


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("n", [64, 96, 1536])
def test_rms_norm_and_the_residual_add_match_the_module(dtype: torch.dtype, unit_offset: bool, n: int) -> None:
    g = torch.Generator().manual_seed(n + unit_offset)
    norm = RMSNorm(n, 1e-6, unit_offset=unit_offset)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(n, generator=g) * 0.5 + (0 if unit_offset else 1))
    norm = norm.to(DEVICE, dtype)
    x = (torch.randn(7, n, generator=g) * 3).to(DEVICE, dtype)
    delta = torch.randn(7, n, generator=g).to(DEVICE, dtype)
    _close(layer_ops.rms_norm(x, norm.weight, norm.eps, unit_offset), norm(x), dtype)
    out, total = layer_ops.add_rms_norm(x, delta, norm.weight, norm.eps, unit_offset)
    assert torch.equal(total, x + delta)  # the new residual is the eager add, exactly
    _close(out, norm(x + delta), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_norm_on_a_strided_view(dtype: torch.dtype) -> None:
    """Qwen 3 / Gemma 3's q/k norms: rows of one head in a view of the
    fused q/k/v output (token stride = the whole projection's width)."""
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, d = 6, 2, 80
    qkv = torch.randn(5, (heads + 2 * kv_heads) * d, generator=g).to(DEVICE, dtype)
    q = qkv[:, : heads * d].unflatten(-1, (heads, d))
    k = qkv[:, heads * d : (heads + kv_heads) * d].unflatten(-1, (kv_heads, d))
    norm = RMSNorm(d, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(d, generator=g) + 0.5)
    norm = norm.to(DEVICE, dtype)
    for x in (q, k):
        _close(layer_ops.rms_norm(x, norm.weight, norm.eps), norm(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(4, 2, 16), (6, 2, 80), (32, 8, 128)])
def test_rope_in_place_matches_apply_rope(dtype: torch.dtype, heads: int, kv_heads: int, d: int) -> None:
    g = torch.Generator().manual_seed(heads * d)
    tokens = 9
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(DEVICE, dtype)
    q = qkv[:, : heads * d].unflatten(-1, (heads, d))
    k = qkv[:, heads * d : (heads + kv_heads) * d].unflatten(-1, (kv_heads, d))
    v_before = qkv[:, (heads + kv_heads) * d :].clone()
    angles = torch.rand(tokens, d // 2, generator=g) * 50
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)
    want_q, want_k = apply_rope(q.clone(), k.clone(), cos, sin)
    got_q, got_k = layer_ops.rope(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    _close(got_q, want_q, dtype)
    _close(got_k, want_k, dtype)
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [24, 1100])
def test_silu_mul_matches_the_gated_mlp(dtype: torch.dtype, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    mlp = GatedMLP(8, n, "silu")
    gate_up = (torch.randn(6, 2 * n, generator=g) * 4).to(DEVICE, dtype)
    gate, up = mlp.gate_up_proj.split(gate_up)
    _close(layer_ops.silu_mul(gate_up), mlp.act(gate) * up, dtype)


def test_shapes_it_cannot_take_are_refused() -> None:
    x = torch.randn(4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="last dim contiguous"):
        layer_ops.rms_norm(x.t(), torch.ones(4, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="cos/sin"):
        layer_ops.rope(x.view(4, 2, 8), x.view(4, 2, 8), x[:, :4], x[:, :4])
    with pytest.raises(ValueError, match="silu_mul"):
        layer_ops.silu_mul(x[:, :15])
    empty = torch.empty(0, 16, device=DEVICE)  # an empty step launches nothing
    assert layer_ops.rms_norm(empty, torch.ones(16, device=DEVICE), 1e-6).shape == (0, 16)
    assert layer_ops.silu_mul(empty).shape == (0, 8)
