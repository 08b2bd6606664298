"""The kernel-only projections benchmark: the model's shapes, the same weights
in every format (so the formats compute the same thing), byte counts, and
one row per format and mode."""

from __future__ import annotations

import pytest
import torch

from paged_server.bench.model_configs import LLAMA_100M
from paged_server.models import few_row_gemm
from paged_server.models.quantization.linear import QuantizedLinear
from quantized_gemm import Projections, gemm_table, projection_shapes

TINY = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}  # fmt: skip


def test_projection_shapes_are_the_100m_models_stacked_layers() -> None:
    assert projection_shapes(LLAMA_100M) == [(1280, 768), (768, 768), (5632, 768), (768, 2816)]


def test_formats_hold_the_same_weights_and_run_serving_kernels() -> None:
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    models = {fmt: Projections(TINY, fmt).eval() for fmt in ("bfloat16", "int8", "int4")}
    kernels = {m.kernel for m in models["int4"].modules() if isinstance(m, QuantizedLinear)}
    assert kernels == {"int4pack_mm"}
    assert {m.kernel for m in models["int8"].modules() if isinstance(m, QuantizedLinear)} == {
        "int8pack_mm"
    }
    with torch.no_grad():
        ref = models["bfloat16"](x).float()
        for fmt, tol in (("int8", 0.02), ("int4", 0.1)):
            out = models[fmt](x).float()
            err = ((out - ref).norm() / ref.norm()).item()
            assert err < tol, (fmt, err)
    sizes = {fmt: m.weight_bytes() for fmt, m in models.items()}
    weights = sum(n * k for n, k in projection_shapes(TINY)) * TINY["num_hidden_layers"]
    assert sizes["bfloat16"] == weights * 2
    assert weights < sizes["int8"] < weights * 1.05  # + a bf16 scale per row
    assert weights * 0.5 < sizes["int4"] < weights * 0.55  # + a bf16 scale and zero per 128


def test_table_has_a_row_per_format_and_mode() -> None:
    table = gemm_table(TINY, rows=1, rounds=1, modes=("eager",), repeat=1)
    assert [(r["format"], r["mode"]) for r in table] == [
        ("bfloat16", "eager"),
        ("int8", "eager"),
        ("int4", "eager"),
    ]
    for r in table:
        assert r["ms"] > 0 and r["gb_s"] > 0
    assert table[0]["speedup_vs_bfloat16"] == 1.0


@pytest.mark.skipif(not few_row_gemm.available(), reason="few_row_gemm needs a C compiler and AVX512-BF16")
def test_the_few_row_format_computes_the_bf16_product() -> None:
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    models = {fmt: Projections(TINY, fmt).eval() for fmt in ("bfloat16", "bf16_few_row")}
    with torch.no_grad():
        ref, out = (models[fmt](x).float() for fmt in ("bfloat16", "bf16_few_row"))
    assert ((out - ref).norm() / ref.norm()).item() < 0.02
    assert models["bf16_few_row"].weight_bytes() == models["bfloat16"].weight_bytes()  # read once
