"""``few_row_gemm``: bf16 products of 1-8 rows against the float32 product of
the same bf16 numbers (the kernel rounds only its output, so it agrees within
a bf16 step of the output's largest value); a row's result the same bits
whatever rows share the call; the layers a model attaches it to, eager and
compiled, against aten's product. Skipped where the kernel cannot be built
(no C compiler, no AVX512-BF16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.server.models.test_cpu_gemv import _threads
from torch._inductor.utils import run_and_get_code

from paged_server.default_model.builder import CONFIG
from paged_server.models import few_row_gemm
from paged_server.models.config import ModelConfig
from paged_server.models.linear import (
    ColumnParallelLinear,
    OutputSlice,
    RowParallelLinear,
    attach_few_row_weights,
)
from paged_server.models.llama import LlamaForCausalLM

pytestmark = pytest.mark.skipif(
    not few_row_gemm.available(), reason="few_row_gemm needs a C compiler and AVX512-BF16"
)


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 2**-8) -> None:
    """Within ``rel`` of the output's largest value (one bf16 step: float32
    sums in another order may round to the neighbouring bf16)."""
    assert got.shape == want.shape, (got.shape, want.shape)
    assert (got.float() - want.float()).abs().max() <= rel * want.float().abs().max()


@pytest.mark.parametrize(("n", "k"), [(512, 256), (4096, 256), (256, 768), (100, 72), (3, 40), (48, 2)])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_product_of_1_to_8_rows_matches_the_float_product(n: int, k: int, threads: int) -> None:
    """Output counts not a multiple of 16 (a padded last block) and of the
    4- and 2-block tiles, every row count, one and two threads."""
    w = _bf16(n, k, seed=n + k)
    packed = few_row_gemm.pack(w)
    for rows in range(1, few_row_gemm.FEW_ROWS + 1):
        x = _bf16(rows, k, seed=rows)
        got = _threads(threads, lambda x=x: torch.ops.paged.few_row_gemm(x, packed, n))
        assert got.dtype == torch.bfloat16
        _close(got, F.linear(x.float(), w.float()))


def test_a_row_gives_the_same_bits_whatever_rows_share_the_call() -> None:
    """Each output sums its products in input order for every row count: a
    sequence's logits do not depend on its neighbours in the step (or on a
    verify step's padding to 8 rows)."""
    w = _bf16(1536, 256, seed=1)
    packed = few_row_gemm.pack(w)
    rows = _bf16(8, 256, seed=2)
    alone = torch.cat([torch.ops.paged.few_row_gemm(rows[i : i + 1], packed, 1536) for i in range(8)])
    for count in range(2, 9):
        together = torch.ops.paged.few_row_gemm(rows[:count], packed, 1536)
        assert torch.equal(together, alone[:count]), count


def test_rows_of_a_wider_tensor_are_read_in_place() -> None:
    """A row stride above the input width (a slice of a stacked output)."""
    wide = _bf16(5, 384, seed=3)
    x = wide[:, 64:320]
    assert x.stride(0) == 384
    w = _bf16(64, 256, seed=4)
    _close(torch.ops.paged.few_row_gemm(x, few_row_gemm.pack(w), 64), F.linear(x.float(), w.float()))


def test_a_nan_in_a_row_gives_nan_outputs() -> None:
    w = _bf16(32, 64, seed=5)
    x = _bf16(2, 64, seed=6)
    x[1, 7] = float("nan")
    out = torch.ops.paged.few_row_gemm(x, few_row_gemm.pack(w), 32)
    assert out[1].isnan().all() and not out[0].isnan().any()


@pytest.fixture
def preferred(monkeypatch: pytest.MonkeyPatch) -> None:
    """``attach_few_row_weights`` packs on this CPU even where it has AMX tiles (where the
    engine does not attach: not measured there)."""
    monkeypatch.setattr(few_row_gemm, "preferred", lambda: True)


@pytest.mark.usefixtures("preferred")
def test_layers_take_the_kernel_at_1_to_8_bf16_rows_eager_and_compiled() -> None:
    """An attached layer runs the kernel at 1-8 rows (in a static compiled
    graph: the opaque op), aten's product at more rows, in float32 and in a
    dynamic graph; the bias is added after."""
    layer = ColumnParallelLinear(256, [OutputSlice("p", 96, 0, 96)], bias=True).to(torch.bfloat16)
    assert attach_few_row_weights(layer) == 1
    with torch.no_grad():
        for rows in (1, 5, 8):
            x = _bf16(rows, 256, seed=rows)
            _close(layer(x), F.linear(x.float(), layer.weight.float(), layer.bias.float()), 2**-7)
        static = torch.compile(layer, fullgraph=True, dynamic=False)
        out, code = run_and_get_code(static, _bf16(4, 256, seed=9))
        assert "paged.few_row_gemm" in "\n".join(code)
        _close(out, layer(_bf16(4, 256, seed=9)), 0)
        dynamic = torch.compile(layer, fullgraph=True, dynamic=True)
        _, code = run_and_get_code(dynamic, _bf16(12, 256, seed=10))
        assert "few_row_gemm" not in "\n".join(code)
    assert few_row_gemm.few_rows(layer, _bf16(9, 256, seed=11)) is None
    assert few_row_gemm.few_rows(layer, _bf16(2, 256, seed=11).float()) is None


@pytest.mark.usefixtures("preferred")
def test_a_model_attaches_its_projections_and_lm_head_and_keeps_its_outputs() -> None:
    """Every stacked projection and the (tied) LM head of a bf16 Llama get a
    packed weight (once); a layer's MLP and the LM head at 1-8 rows stay
    within bf16 rounding of aten's product. A float32 model gets none."""
    hf = {**CONFIG, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2}
    config = ModelConfig.from_hf(hf, "LlamaForCausalLM")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    linears = [m for m in model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
    mlp = model.model.layers[0].mlp
    x = _bf16(6, 128, seed=12)
    with torch.no_grad():
        before, logits_before = mlp(x), model.compute_logits(x)
        assert attach_few_row_weights(model) == len(linears) + 1
        assert all(hasattr(m, "few_row_weight") for m in [*linears, model.lm_head])
        assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: packed from the embedding
        assert attach_few_row_weights(model) == 0
        _close(mlp(x), before, 2**-5)
        _close(model.compute_logits(x), logits_before)
    assert attach_few_row_weights(LlamaForCausalLM(config)) == 0
