"""Weight-only quantized GEMM on a GPU: each of the layer's two CUDA paths
at every M, side by side, so :data:`quant_matmul.DENSE_ROWS` (where the
layer switches) can be set from the numbers:

- ``kernel_ms``: ``paged_triton.quant_matmul``, forced at every M (above
  ``DENSE_ROWS`` the layer would not run it; its prefill tile may then
  JIT-compile here, which the timing excludes);
- ``dense_ms``: the layer's dense path, forced at every M: the weight
  dequantized in one Triton pass (``quant_dequantize``), then cuBLAS;
- ``torch_dense_ms``: the fallback's dense path,
  ``QuantizedLinear.dequantized_weight`` (tensor ops) then cuBLAS, for
  comparison with the one-pass dequantize;
- ``bf16_ms``: the 16-bit matmul alone;
- ``path`` / ``layer_ms``: the path the layer picks at this M
  (``quant_matmul.prefers_dense``) and its time;
- ``best``: the faster of ``kernel`` and ``dense`` at this M.

Llama 3.1 8B's o_proj (4096 x 4096) and fused gate/up (28672 x 4096)
projections, bf16 activations, M = 1 (decode) to 2048 (prefill) rows, for
int8 per output channel, int4 in groups of 128, and int4 with zero points
(AWQ / W4A16 asym).

How it times, and why: the engine replays decode steps from CUDA graphs
(engine/worker/decode_graphs.py), and in a model each layer reads a weight the
previous layers have pushed out of L2. So the ``*_ms`` columns are GPU
time per call inside one CUDA graph that cycles over enough copies of the
weight (3x the L2 cache) that every call reads it from HBM, with no host
in the loop. An eager call costs more than its kernels: ``host_us`` is
the Python and launch time of one eager layer call (measured with the GPU
kept busy, so it is the host's alone), ``launch_us`` the part of it that
is Triton's launch of the planned kernel, and ``eager_ms`` what
``triton.testing.do_bench`` reports for the eager layer call with L2
flushed (it reads the host's time, not the GPU's, whenever the host is
the slower of the two).

``test_decode_split_k`` times the decode kernel at each split-K width, to
check :func:`quant_matmul.split_k`'s choice.

Needs CUDA (``nox -s gpu`` runs it; benchmarks/quant_matmul_gpu_check.sh
runs it alone and prints the table); skipped elsewhere.
Run: ``pytest benchmarks/test_quant_matmul_bench.py --benchmark-only -p no:randomly``.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest
import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from paged_server.models.quantization.linear import QuantizedLinear
    from paged_triton.quant_matmul import QuantWeight

CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not CUDA, reason="GPU benchmark: needs CUDA (nox -s gpu)"),
]

SHAPES = {"o 4096x4096": (4096, 4096), "gate_up 28672x4096": (28672, 4096)}
ROWS = (1, 16, 64, 128, 256, 512, 2048)  # both paths at each: the crossover
# name -> (bits, group size (None: per output channel), zero points)
FORMATS = {"int8 per-channel": (8, None, False), "int4 g128": (4, 128, False),
           "int4 g128 asym": (4, 128, True)}  # fmt: skip
ROUNDS = 5  # passes over the weight copies captured in one graph
SPLITS = (1, 2, 4, 8, 16)


def _layer(n: int, k: int, bits: int, group: int | None, asym: bool) -> QuantizedLinear:
    from paged_server.models.quantization.linear import QuantizedLinear
    from paged_server.models.quantization.weights import QuantizedWeight, quantize_int

    gen = torch.Generator(device="cuda").manual_seed(0)
    dense = torch.randn(n, k, generator=gen, device="cuda") * 0.02
    w = quantize_int(dense, bits, group)
    if asym:
        zeros = torch.randint(-2, 3, w.scales.shape, generator=gen, device="cuda", dtype=torch.int8)
        w = QuantizedWeight(w.qweight, w.scales, zeros, bits, w.group_size)
    layer = QuantizedLinear(w, None, torch.device("cuda"))
    assert layer.kernel == "quant_matmul", layer.kernel
    return layer


def _weight(layer: QuantizedLinear) -> QuantWeight:
    from paged_triton.quant_matmul import QuantWeight  # imports triton: CUDA only

    return QuantWeight(layer.qweight, layer.scales, layer.zeros, layer.bits, layer.group_size)


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _count(nbytes: int) -> int:
    """How many copies of ``nbytes`` fill 3x the L2 cache, so a graph
    cycling over them reads each from HBM."""
    l2 = getattr(torch.cuda.get_device_properties(), "L2_cache_size", 50 << 20)
    return min(32, max(1, -(-3 * l2 // nbytes)))


def _copies(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Enough clones of ``tensor`` (the first is itself) to read it cold."""
    return [tensor, *(tensor.clone() for _ in range(_count(_nbytes(tensor)) - 1))]


def _layers(layer: QuantizedLinear) -> list[QuantizedLinear]:
    """Enough copies of a quantized ``layer`` (the first is itself; the
    others own clones of its weight) to read its weight cold."""
    count = _count(_nbytes(layer.qweight, layer.scales, layer.zeros))
    return [layer, *(copy.deepcopy(layer) for _ in range(count - 1))]


def _graph_ms(calls: list[Callable[[], object]]) -> float:
    """GPU ms per call: every call once per round, :data:`ROUNDS` rounds
    captured in one CUDA graph, the median of five replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile, and warm the allocator, outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(ROUNDS):
            for call in calls:
                call()
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (ROUNDS * len(calls)))
    del graph
    return statistics.median(times)


def _host_us(call: Callable[[], object], count: int = 40) -> float:
    """Host microseconds per ``call``, the GPU kept busy meanwhile (a sleep
    kernel ahead of them) so no call waits for it."""
    call()
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # ~50 ms at 2 GHz: longer than the calls' host time
    start = time.perf_counter()
    for _ in range(count):
        call()
    host = (time.perf_counter() - start) / count
    torch.cuda.synchronize()
    return host * 1e6


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quant_matmul(benchmark, fmt, shape, m):
    import triton.testing

    from paged_triton import kernel_bench
    from paged_triton import quant_matmul as qm
    from paged_triton.quant_dequantize import dequantize

    n, k = SHAPES[shape]
    bits, group, asym = FORMATS[fmt]
    layer = _layer(n, k, bits, group, asym)
    g = layer.group_size
    dense = layer.dequantized_weight(torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    want = F.linear(x, dense)

    def forced_kernel(q: QuantizedLinear) -> torch.Tensor:  # even from DENSE_ROWS rows
        return qm.quant_matmul(x, _weight(q))

    def forced_dense(q: QuantizedLinear) -> torch.Tensor:  # the layer's path from DENSE_ROWS
        return F.linear(x, dequantize(_weight(q), x.dtype))

    def torch_dense(q: QuantizedLinear) -> torch.Tensor:  # the fallback's path
        return F.linear(x, q.dequantized_weight(x.dtype))

    paths = {"kernel": forced_kernel, "dense": forced_dense, "torch_dense": torch_dense}
    for got in (layer(x), *(path(layer) for path in paths.values())):
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)

    layers = _layers(layer)
    ms = {name: _graph_ms([lambda q=q, f=f: f(q) for q in layers]) for name, f in paths.items()}
    layer_ms = _graph_ms([lambda q=q: q(x) for q in layers])  # whichever path it picks
    bf16_ms = _graph_ms([lambda w=w: F.linear(x, w) for w in _copies(dense)])
    kernel_ms, dense_ms = ms["kernel"], ms["dense"]
    path = "dense" if qm.prefers_dense(m) else "kernel"

    tile, splits = qm.variant(m, n, k, g, x.device)
    out = torch.empty(m, n, device="cuda", dtype=x.dtype)
    if splits > 1:
        out = torch.empty(splits, m, n, device="cuda", dtype=torch.float32)
    launch = qm.plan_quant_matmul(x, _weight(layer), out, splits, tile)
    eager_ms = float(triton.testing.do_bench(lambda: layer(x), warmup=5, rep=20))
    weight_bytes = _nbytes(layer.qweight, layer.scales, layer.zeros)
    gbps = weight_bytes / (kernel_ms * 1e-3) / 1e9
    peak = kernel_bench.peak_bandwidth(x.device)
    benchmark.group = "quant matmul"
    benchmark.extra_info.update(
        case=f"{fmt} {shape} M={m}",
        impl="triton",
        device=torch.cuda.get_device_name(),
        dtype="bfloat16",
        m=m,
        n=n,
        k=k,
        splits=splits,
        copies=len(layers),
        kernel_ms=kernel_ms,
        dense_ms=dense_ms,
        torch_dense_ms=ms["torch_dense"],
        bf16_ms=bf16_ms,
        path=path,
        best="dense" if dense_ms < kernel_ms else "kernel",
        layer_ms=layer_ms,
        speedup_vs_dense=dense_ms / kernel_ms,
        speedup_vs_bf16=bf16_ms / layer_ms,
        eager_ms=eager_ms,
        host_us=_host_us(lambda: layer(x)),
        launch_us=_host_us(launch.run),
        weight_bytes=weight_bytes,
        GBps=gbps,
        pct_of_peak=None if peak is None else 100 * gbps * 1e9 / peak,
        TFLOPs=2 * m * n * k / (kernel_ms * 1e-3) / 1e12,
        timing="CUDA graph over cold weight copies; eager_ms: do_bench, L2 flushed",
    )

    def call() -> None:
        layer(x)
        torch.cuda.synchronize()

    benchmark.pedantic(call, rounds=3, warmup_rounds=1)


@pytest.mark.parametrize("m", (1, 16))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("fmt", ["int8 per-channel", "int4 g128"])
def test_decode_split_k(benchmark, fmt, shape, m):
    """The decode kernel at each split-K width (GPU ms per call, cold weights)."""
    from paged_triton import quant_matmul as qm

    n, k = SHAPES[shape]
    bits, group, asym = FORMATS[fmt]
    layer = _layer(n, k, bits, group, asym)
    g = layer.group_size
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    layers = _layers(layer)
    chosen = qm.variant(m, n, k, g, x.device)[1]
    ms = {
        s: _graph_ms(
            [
                lambda q=q, s=s: qm.quant_matmul(x, _weight(q), splits=s)
                for q in layers
            ]
        )
        for s in SPLITS
    }
    benchmark.group = "quant matmul split-K"
    benchmark.extra_info.update(
        case=f"{fmt} {shape} M={m}",
        chosen_splits=chosen,
        split_ms={str(s): v for s, v in ms.items()},
        best_splits=min(ms, key=ms.__getitem__),
    )
    benchmark.pedantic(lambda: None, rounds=1)
