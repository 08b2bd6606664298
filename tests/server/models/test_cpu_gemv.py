"""``cpu_gemv``: the one-row int4/int8 kernels against the exact float
product of their int8-rounded activations (``quantize_row``) and the
dequantized weight: both round only their bf16 output, so they agree within
a bf16 step of the output's largest value. Against aten's kernels on the
same buffers (bf16 activations) they differ by the activation rounding:
within 3% of the largest value on these random rows. Skipped where the
kernels cannot be built (no C compiler, no AVX512 VNNI/VBMI)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tests.server.models.test_quantization_online import _weight
from torch._inductor.utils import run_and_get_code

from paged_server.models.quantization import QuantizedLinear, cpu_gemv

pytestmark = pytest.mark.skipif(
    not cpu_gemv.available(), reason="cpu_gemv needs a C compiler and AVX512 VNNI/VBMI"
)

CPU = torch.device("cpu")


def _threads(threads: int, product: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``product()`` on ``threads`` torch (and so OpenMP) threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return product()
    finally:
        torch.set_num_threads(before)


def _row(k: int, seed: int) -> torch.Tensor:
    return torch.randn(1, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 2**-8) -> None:
    """Within ``rel`` of the output's largest value (default: one bf16 step:
    float32 sums in another order may round to the neighbouring bf16)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert (got.float() - want.float()).abs().max() <= rel * want.float().abs().max()


ROUNDING = 3e-2  # int8 activations against bf16 ones (~1% seen)


@pytest.mark.parametrize(
    ("n", "k", "group", "asym"),
    [(64, 256, 32, False), (128, 256, 64, True), (192, 512, 128, True), (1280, 768, 256, False)],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_int4_matches_aten_and_the_dequantized_product(
    n: int, k: int, group: int, asym: bool, threads: int
) -> None:
    w = _weight(n, k, 4, group, asym, seed=n + k)
    layer = QuantizedLinear(w, None, CPU)
    assert layer.kernel == "int4pack_mm" and layer.one_row
    x = _row(k, seed=k)
    got = _threads(threads, lambda: cpu_gemv.int4_gemv(x, layer.qweight, layer.scales, group))
    # the weight as the layer keeps it: scales and zero terms rounded to bf16
    scales = w.scales.to(torch.bfloat16).float()
    zero = 0 if w.zeros is None else (-w.zeros.float() * w.scales).to(torch.bfloat16).float()
    weight = w.qweight.float() * scales.repeat_interleave(group, 1)
    if w.zeros is not None:
        weight += zero.repeat_interleave(group, 1)
    exact = F.linear(cpu_gemv.quantize_row(x, group), weight)
    _close(got, exact.to(torch.bfloat16))
    aten = torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer.qweight, layer.group_size, layer.scales)
    _close(got, aten, ROUNDING)


@pytest.mark.parametrize(("n", "k"), [(64, 256), (102, 768), (7, 128)])  # rows past a multiple of 4
@pytest.mark.parametrize("threads", [1, 2])
def test_int8_matches_aten_and_the_dequantized_product(n: int, k: int, threads: int) -> None:
    w = _weight(n, k, 8, k, False, seed=n + k)
    layer = QuantizedLinear(w, None, CPU)
    assert layer.kernel == "int8pack_mm" and layer.one_row
    x = _row(k, seed=k)
    got = _threads(threads, lambda: cpu_gemv.int8_gemv(x, layer.qweight, layer.scales))
    # the scale is rounded to bf16 as aten's kernel takes it
    exact = F.linear(cpu_gemv.quantize_row(x, cpu_gemv.INT8_BLOCK), w.qweight.float())
    _close(got, (exact * layer.scales.float()).to(torch.bfloat16))
    _close(got, torch.ops.aten._weight_int8pack_mm(x, layer.qweight, layer.scales), ROUNDING)


def test_layers_the_kernels_cannot_take_keep_aten() -> None:
    """int4 outputs not a multiple of 64 columns (aten's last block is laid
    out differently) and int8 inputs not a multiple of 128 stay on aten."""
    assert not QuantizedLinear(_weight(96, 256, 4, 128, False, 0), None, CPU).one_row
    assert not QuantizedLinear(_weight(64, 192, 8, 192, False, 0), None, CPU).one_row


@pytest.mark.parametrize("bits", [4, 8])
def test_one_row_layers_call_the_kernel_eager_and_compiled(bits: int) -> None:
    """A single row runs the kernel (in a compiled graph: an opaque op call),
    more rows run aten's, and both compute the same product."""
    w = _weight(128, 256, bits, 128 if bits == 4 else 256, bits == 4, seed=3)
    layer = QuantizedLinear(w, torch.randn(128), CPU)
    x = _row(256, seed=5)
    eager = layer(x)
    layer.one_row = False
    _close(eager, layer(x), ROUNDING)
    layer.one_row = True
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    with torch.no_grad():
        out, code = run_and_get_code(compiled, x)
    assert f"paged.int{bits}_gemv" in "\n".join(code)
    _close(out, eager)
    rows = torch.randn(3, 256).to(torch.bfloat16)
    with torch.no_grad():
        out, code = run_and_get_code(compiled, rows)
    assert "gemv" not in "\n".join(code)
    _close(out, layer(rows))


@pytest.mark.parametrize("bits", [4, 8])
def test_a_nan_or_inf_in_the_row_gives_nan_outputs(bits: int) -> None:
    """As a float product would: the engine must see a poisoned row as NaN,
    not as finite numbers made from rounded garbage."""
    w = _weight(64, 256, bits, 128 if bits == 4 else 256, False, seed=7)
    layer = QuantizedLinear(w, None, CPU)
    assert layer.one_row
    for bad in (float("nan"), float("inf")):
        x = _row(256, seed=8)
        x[0, 3] = bad
        assert layer(x).isnan().all(), bad


# In a child process: the kernels are built once per process, and (before
# the cache verified its files) a truncated one killed its process with SIGBUS.
_GENERATE = """
import sys
from paged_server.entrypoints.llm import LLM
from paged_server.models.quantization import cpu_gemv
from paged_server.sampling_params import SamplingParams
greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
with LLM(sys.argv[1], quantization="int8", device="cpu", max_model_len=64, max_batch_size=2) as llm:
    out = llm.generate(prompt_token_ids=[[5, 80, 33, 190]], sampling_params=greedy, use_tqdm=False)
print(cpu_gemv.available(), list(out[0].outputs[0].token_ids))
"""


@pytest.mark.parametrize("damage", ["truncated", "not a directory"])
def test_the_engine_starts_and_serves_past_a_damaged_kernel_cache(
    damage: str, checkpoints: dict[str, Any], tmp_path: Path
) -> None:
    """A truncated cached library is rebuilt (same tokens as before); a
    cache that is not a directory leaves aten's kernels; one warning each."""

    def generate(cache: Path) -> tuple[str, str]:
        env = {**os.environ, "PAGED_CACHE_DIR": str(cache)}
        child = subprocess.run(
            [sys.executable, "-c", _GENERATE, str(checkpoints["llama"].path)],
            capture_output=True, text=True, env=env, timeout=600,
        )  # fmt: skip
        assert child.returncode == 0, f"exit {child.returncode}: {child.stderr[-2000:]}"
        return child.stdout.strip().splitlines()[-1], child.stderr

    cache = tmp_path / "cache"
    clean, _ = generate(cache)
    assert clean.startswith("True [")
    if damage == "truncated":
        (library,) = (cache / "cpu_gemv").glob("*.so")
        with library.open("r+b") as f:
            f.truncate(library.stat().st_size // 2)
        served, log = generate(cache)
        assert served == clean
    else:
        (tmp_path / "file").write_text("")
        served, log = generate(tmp_path / "file")
        assert served.startswith("False [") and len(served.split(",")) == 6
    warned = [ln for ln in log.splitlines() if "checksum" in ln or "PAGED_CACHE_DIR" in ln]
    assert len(warned) == 1, log[-2000:]
