"""The forward pass compiled with ``torch.compile``, attention left opaque.

Eager PyTorch pays Python and dispatcher time for every small op (norms,
RoPE, residual adds, activations); on a CPU that is a few milliseconds per
decode step of a small model. Inductor fuses those ops into generated C++
and calls the GEMMs directly. Attention stays outside the graph, as in
vLLM: each layer's ``kv_cache.attend`` becomes one call of the custom op
``paged::attention``, which reaches the step's real cache view through
``_step`` (set around the call). The graph therefore sees only tensors and
constants, never the pool, so one compile serves every step.

Weights are frozen into the graph (inductor's ``freezing``): on a CPU the
projections then run as oneDNN matmuls on weights packed once at compile
time, which beat ``F.linear`` by 1.3-2x at 1-32 tokens (bf16 on AMX most).
The packed copies sit beside the module's own weights (the eager paths
still use those), so the projections' weights take twice the memory.

The token dimension is dynamic: one graph for single-token steps (torch
specialises size 1), one static graph for steps of 2..``ROW_BUCKET`` rows
(``few_rows``) and one for everything else, all compiled by the runner's
warm-up so serving never compiles. ``--enforce-eager`` turns it off.

The few-row graph is there for speculative decoding's verify step (one
sequence's last token and its drafts, 5 rows at k=4) and a few decodes.
It runs every GEMM on inductor's C++ template as the one-token graph
does: weight-bound at that size, where oneDNN's packed matmuls at 8 rows
cost 2-3x the template's (a 5-row verify step of the embedded model 9.5
against 2.8 ms, one thread, AMX Xeon); from 32 rows on oneDNN wins (a
32-decode step 10 against 15 ms), so the dynamic graph keeps it. bf16
weights on a CPU without AMX are the exception: there oneDNN wins at 8
rows too (0.83 against 1.4 ms), so their few-row graphs take it; where
``few_row_gemm`` builds (AVX512-BF16, no AMX) their projections run that
kernel instead (``models/linear.py``: 0.55 against 0.88 ms for a 5-row step).

A step of at most ``ROW_BUCKET`` rows that samples every row (a single
stream's decode, one sequence's verify step) runs the layers and the LM
head as one graph (``logits``): one Dynamo and AOT wrapper chain instead
of two.

A draft model's passes (speculative decoding) have graphs of their own,
static at 1 and ``ROW_BUCKET`` rows: ``greedy_passes`` runs the layers, the
LM head and the argmax in one graph, once or for the ``k - 1`` one-token
passes that feed each argmax back, pass ``i``'s attention over
``_step.views[i]`` (the op's ``index``).

LoRA adapters (``--enable-lora``) stay opaque the same way: a step with
adapters runs graphs of their own (one-token and multi-row, compiled by the
warm-up too) in which every projection's delta is one call of the in-place
op ``paged::lora_delta``; it reads the step's ``LoRAMapping`` from ``_step``
and the projection's slot table from ``_LORA_TABLES`` (by number), so the
graph holds neither and one compile serves every step and every adapter.

The rows of a multi-row step are padded to a multiple of ``ROW_BUCKET``
(``padded_rows``), and the runner's warm-up runs every bucket once: oneDNN
builds (JIT-compiles) a matmul the first time it sees a row count, and
under serving, where decodes and prompt chunks make row counts of every
size, those steps were the inter-token latency's tail. Padding rows never reach attention:
``paged::attention`` attends the real rows and returns zeros for the rest.
"""

from __future__ import annotations

import os
import threading
import types
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch
import torch._dynamo.config as dynamo_config
import torch._inductor.config as inductor_config
from torch import Tensor, nn

from paged_core.protocols import AttentionViewProtocol
from paged_server import attention_backends
from paged_server.platform import cpu_has_amx, platform_for

if TYPE_CHECKING:
    from paged_ref.lora_ops import LoRAMapping
    from paged_server.config import EngineConfig
    from paged_server.models.base import CausalLM
    from paged_server.models.lora.layers import LoRAWeights


class _Step(threading.local):
    """The view of the step being computed on this thread (engines on two
    threads in one process each see their own), and how many of the
    graph's rows are the step's tokens (the rest are padding)."""

    view: AttentionViewProtocol | None = None
    rows: int = 0
    lora: LoRAMapping | None = None  # the step's adapters, when it has any
    views: tuple[AttentionViewProtocol, ...] = ()  # a draft's passes in one graph: each pass's view


_step = _Step()

GRAPHS_PER_ENGINE = 2  # per code object: single-token steps (one row), and the rest
ROW_BUCKET = 8  # a multi-row step's rows are padded to a multiple of this, twice it above 64


def padded_rows(rows: int) -> int:
    """The rows a step of ``rows`` tokens (or sampled rows) runs with: one
    stays one (its own graph); more are rounded up to a multiple of
    ``ROW_BUCKET``, of twice it above 64 rows (half as many counts to warm
    up where each costs more, at most 15 rows of padding)."""
    if rows <= 1:
        return rows
    bucket = ROW_BUCKET if rows <= 64 else 2 * ROW_BUCKET
    return -(-rows // bucket) * bucket


def few_rows(rows: int) -> bool:
    """Whether a step of ``rows`` rows runs the few-row graph (module doc)."""
    return 1 < rows <= ROW_BUCKET


def row_buckets(max_rows: int) -> list[int]:
    """Every row count ``padded_rows`` gives for 1..``max_rows`` rows, ascending."""
    return sorted({padded_rows(n) for n in range(1, max_rows + 1)})


def attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layer_idx: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    index: int = -1,
) -> Tensor:
    """``_step.view.attend(...)``: writes this layer's k/v into the cache and
    attends; the cache is not an argument, so the graph cannot see it.
    ``index`` >= 0: pass ``index`` of a graph that runs several
    (``CompiledForward.greedy_passes``), over ``_step.views[index]``.
    Padding rows (past ``_step.rows``) are neither written nor attended."""
    view = _step.view if index < 0 else (_step.views[index] if index < len(_step.views) else None)
    if view is None:
        raise RuntimeError("paged::attention called outside a compiled step")
    rows = _step.rows
    if rows == q.shape[0]:
        return view.attend(  # type: ignore[no-any-return]
            layer_idx, q, k, v, scale=scale, sliding_window=sliding_window, softcap=softcap
        )
    out = q.new_zeros(q.shape)
    out[:rows] = view.attend(
        layer_idx, q[:rows], k[:rows], v[:rows], scale=scale, sliding_window=sliding_window,
        softcap=softcap,
    )  # fmt: skip
    return out


# Both ops are defined through torch.library.Library, not custom_op (as
# cpu_gemv's ops): a step calls attention once per layer (and lora_delta
# once per projection and layer), and custom_op's Python wrappers cost
# several times this dispatch (docs/cpu.md): ~5 us a call, 4% of a one-token
# step of the embedded model.
_LIB = torch.library.Library("paged", "FRAGMENT")
_LIB.define(
    "attention(Tensor q, Tensor k, Tensor v, int layer_idx, float scale, int? sliding_window, "
    "float? softcap, int index=-1) -> Tensor"
)
_LIB.impl("attention", attention_op, "CompositeExplicitAutograd")
_LIB.impl("attention", lambda q, *args: torch.empty_like(q), "Meta")


class _OpaqueView:
    """What the compiled model receives as its ``kv_cache``: ``attend`` is
    the custom op (a constant object, so it adds no guard that could fail);
    ``index``: the op's (-1: the step's view)."""

    def __init__(self, index: int = -1) -> None:
        self.index = index

    def attend(
        self,
        layer_idx: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> Tensor:
        return torch.ops.paged.attention(q, k, v, layer_idx, scale, sliding_window, softcap, self.index)  # type: ignore[no-any-return]


_OPAQUE = _OpaqueView()

# Every compiled model's LoRA slot tables, by ``LoRAWeights.compiled_index``.
_LORA_TABLES: list[LoRAWeights] = []


def _lora_delta(x: Tensor, out: Tensor, table: int) -> None:
    """Add the step's adapter deltas of slot table ``table`` to ``out`` in
    place (the mapping is ``_step.lora``, padded to the graph's rows)."""
    mapping = _step.lora
    if mapping is None:
        raise RuntimeError("paged::lora_delta called outside a compiled step with adapters")
    _LORA_TABLES[table].apply(x, out, mapping)


# In place (``out``): custom_op would also clone ``out`` and copy it back.
_LIB.define("lora_delta(Tensor x, Tensor(a!) out, int table) -> ()")
_LIB.impl("lora_delta", _lora_delta, "CompositeExplicitAutograd")
_LIB.impl("lora_delta", lambda x, out, table: None, "Meta")


class _OpaqueLoRA:
    """What the compiled model receives as its ``lora``: each projection's
    ``LoRAWeights.apply`` hands it the delta to add, which it adds with the
    op (a constant object: it adds no guard that could fail)."""

    def add(self, weights: LoRAWeights, x: Tensor, out: Tensor) -> None:
        torch.ops.paged.lora_delta(x, out, weights.compiled_index)


_OPAQUE_LORA = _OpaqueLoRA()


class CompiledForward:
    """``hidden_states(input_ids, position_ids, view)`` through the compiled
    ``model.model`` (embeddings, layers, final norm), and ``compute_logits``
    (the LM head on the sampled rows) compiled on its own, faster than
    eager at one row."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        # Every engine's graphs sit in Dynamo's cache of the one code object
        # its model class's forward shares; at the default limit (8) the fifth
        # compiled engine in a process failed (fullgraph). Each makes room for its own.
        dynamo_config.recompile_limit += GRAPHS_PER_ENGINE
        self._compiled: Callable[..., Tensor] = torch.compile(  # type: ignore[assignment]
            model.model, dynamic=True, fullgraph=True
        )
        self._logits: Callable[[Tensor], Tensor] = torch.compile(  # type: ignore[assignment]
            model.compute_logits, dynamic=True, fullgraph=True
        )
        # The few-row graphs (module doc), static at ROW_BUCKET rows: each
        # engine's on code objects of its own, so Dynamo keeps them apart
        # from the dynamic graphs and from other engines' (no cache limit).
        inner, head = model.model, model.compute_logits
        self._few = _static_graph(lambda ids, positions, view: inner(ids, positions, view))
        self._few_logits = _static_graph(lambda hidden: head(hidden))
        # A step of at most ROW_BUCKET rows that samples every row (one
        # stream's decode, a verify step): the layers and the LM head in one
        # graph, static at 1 and ROW_BUCKET rows (``logits``).
        self._few_head = _static_graph(lambda ids, positions, view: head(inner(ids, positions, view)))
        self._passes: dict[int, Callable[..., Tensor]] = {}  # greedy_passes' graphs, by pass count
        self._freezing = inductor_config.patch(freezing=True, **_gemm_template_options(model))
        # The one-token graph (a single stream's decode) runs every GEMM on
        # the template, dense models too: at one row it beats oneDNN's packed
        # bf16 matmuls (1.37x over the 100M model's 48 projections, one
        # thread; 1.2-1.5x for a 30M layer's); at 8 rows they tied.
        self._freezing_one_row = inductor_config.patch(**ONE_ROW_OPTIONS)
        # The few-row graphs (2..ROW_BUCKET rows) too, except for bf16 weights
        # on a CPU without AMX (AVX512-BF16 alone), where oneDNN's packed
        # matmuls win: an 8-row step of the embedded model 0.83-0.87 against
        # 1.36-1.42 ms on the template (2-core AMD EPYC, one thread; in
        # float32 there the template wins, 1.32 against 1.84). Where
        # few_row_gemm is attached (that same case, with a C compiler) their
        # projections run the kernel instead: these settings then leave no
        # GEMM to choose for, and matter where the kernel cannot build.
        dense_bf16 = not _gemm_template_options(model) and next(model.parameters()).dtype == torch.bfloat16
        self._freezing_few = self._freezing if dense_bf16 and not cpu_has_amx() else self._freezing_one_row
        tables: list[LoRAWeights] = [
            w for m in model.modules() if (w := getattr(m, "lora_weights", None)) is not None
        ]
        for table in tables:  # the adapters' slot tables, numbered for the custom op
            table.compiled_index = len(_LORA_TABLES)
            _LORA_TABLES.append(table)
        if tables:  # the steps with adapters: two graphs more
            dynamo_config.recompile_limit += GRAPHS_PER_ENGINE
        self.has_lora = bool(tables)

    def hidden_states(
        self, input_ids: Tensor, position_ids: Tensor, kv_cache: AttentionViewProtocol | None,
        lora: LoRAMapping | None = None,
    ) -> Tensor:  # fmt: skip
        """The final-norm hidden states of the step's rows; ``lora``: the
        step's adapters (built for ``padded_rows`` rows), None for none."""
        if kv_cache is None:  # scoring without a cache: not what serving runs
            return self.model.hidden_states(input_ids, position_ids, None)  # type: ignore[operator,no-any-return]
        rows = input_ids.shape[0]
        _step.view, _step.rows, _step.lora = kv_cache, rows, lora
        try:
            if lora is None and few_rows(rows):
                with self._freezing_few:
                    return self._few(_pad(input_ids), _pad(position_ids), _OPAQUE)[:rows]
            with self._freezing_for(rows):
                if lora is None:
                    return self._compiled(_pad(input_ids), _pad(position_ids), _OPAQUE)[:rows]
                return self._compiled(_pad(input_ids), _pad(position_ids), _OPAQUE, None, _OPAQUE_LORA)[:rows]
        finally:
            _step.view, _step.lora = None, None

    def logits(self, input_ids: Tensor, position_ids: Tensor, kv_cache: AttentionViewProtocol) -> Tensor:
        """``compute_logits(hidden_states(...))`` of every row of a step of at
        most ``ROW_BUCKET`` rows, in one compiled call instead of two (one
        Dynamo and AOT wrapper chain less: ~6% of a one-token step of the
        embedded model)."""
        rows = input_ids.shape[0]
        assert rows <= ROW_BUCKET, "logits takes at most ROW_BUCKET rows"
        _step.view, _step.rows = kv_cache, rows
        try:
            with self._static_freezing(rows):
                return self._few_head(_pad(input_ids), _pad(position_ids), _OPAQUE)[:rows]
        finally:
            _step.view = None

    def greedy_passes(self, input_ids: Tensor, position_ids: Tensor, views: Sequence[AttentionViewProtocol]) -> Tensor:
        """``len(views)`` greedy passes of at most ``ROW_BUCKET`` rows in one
        graph (the layers, the LM head and the argmax): pass ``i`` feeds back
        pass ``i - 1``'s argmax (``input_ids`` first) at ``position_ids + i``
        over ``views[i]``; ``[rows, passes]`` tokens. One pass is a draft
        model's catch-up or a single draft (one compiled call, not two: ~0.7
        instead of ~1.0 ms on the trained default's 2-layer draft); ``k - 1``
        are its one-token passes in one call."""
        rows, n = input_ids.shape[0], len(views)
        assert rows <= ROW_BUCKET, "greedy_passes takes at most ROW_BUCKET rows"
        graph = self._passes.get(n)
        if graph is None:
            graph = self._passes[n] = _passes_graph(self.model, n)
        _step.views, _step.rows = tuple(views), rows
        try:
            with self._static_freezing(rows):
                return graph(_pad(input_ids), _pad(position_ids))[:rows]
        finally:
            _step.views = ()

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """The model's ``compute_logits`` compiled: one graph for one row
        (one sampled sequence), one for more (padded as the step's rows)."""
        rows = hidden.shape[0]
        if few_rows(rows):
            with self._freezing_few:
                return self._few_logits(_pad(hidden))[:rows]
        with self._freezing_for(rows):
            return self._logits(_pad(hidden))[:rows]

    def _freezing_for(self, rows: int) -> AbstractContextManager[object]:
        """Inductor's settings for a dynamic graph of ``rows`` rows. Freezing
        is read when a graph compiles (torch.compile's options do not reach
        it), so it is set around every call, not globally."""
        return self._freezing_one_row if rows == 1 else self._freezing

    def _static_freezing(self, rows: int) -> AbstractContextManager[object]:
        """The same for a static graph of at most ``ROW_BUCKET`` rows."""
        return self._freezing_one_row if rows == 1 else self._freezing_few


def _passes_graph(model: nn.Module, n: int) -> Callable[..., Tensor]:
    """``greedy_passes``' compiled graph for ``n`` passes (static rows)."""
    inner, head = model.model, model.compute_logits
    views = tuple(_OpaqueView(i) for i in range(n))

    def passes(ids: Tensor, positions: Tensor) -> Tensor:
        out = []
        for i, view in enumerate(views):
            ids = head(inner(ids, positions + i, view)).argmax(-1)
            out.append(ids)
        return torch.stack(out, dim=1)

    return _static_graph(passes)


def _static_graph(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``fn`` compiled with static shapes on a code object of its own, without
    Dynamo's guards on the model's modules: a call checks its inputs' guards
    only. Those module guards (every parameter and attribute of every layer)
    took ~0.31 ms a call on the 30m bench model, 13% of a one-token step, and
    they guard nothing here: this engine's graphs alone sit on this code
    object, and its modules do not change once it serves (weights are frozen
    into the graph). The dynamic graphs, which compile the model class's
    shared forward, keep them: there they tell engines apart."""
    return torch.compile(  # type: ignore[no-any-return]
        _own_code(fn), dynamic=False, fullgraph=True,
        options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe},
    )  # fmt: skip


def _own_code(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``fn`` on a copy of its code object: Dynamo caches graphs per code object."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _pad(x: Tensor) -> Tensor:
    """``x`` with zero rows appended up to ``padded_rows`` (``x`` itself when none are)."""
    rows = x.shape[0]
    extra = padded_rows(rows) - rows
    if not extra:
        return x
    return torch.cat([x, x.new_zeros(extra, *x.shape[1:])])


def _gemm_template_options(model: nn.Module) -> dict[str, object]:
    """Inductor settings for a model with packed int8/int4 weights: lower
    aten's weight-only kernels to inductor's C++ GEMM template (its only
    backend, so nothing is benchmarked at compile time). The template
    dequantizes inside a register-blocked micro-kernel (AVX512 at a few
    rows, AMX above), faster than aten's own kernels at every row count.
    Dense models keep oneDNN's packed matmuls."""
    from paged_server.models.quantization.linear import uses_packed_cpu_kernels

    if not uses_packed_cpu_kernels(model):
        return {}
    return _CPP_GEMM_TEMPLATE


# Inductor's C++ GEMM template as the only GEMM backend (nothing benchmarked at compile time).
_CPP_GEMM_TEMPLATE: dict[str, object] = {"max_autotune_gemm": True, "max_autotune_gemm_backends": "CPP"}
# Inductor's settings for the one-token graph (also what benchmarks/quantized_gemm.py compiles with).
ONE_ROW_OPTIONS: dict[str, object] = {"freezing": True, **_CPP_GEMM_TEMPLATE}


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process (tests check that serving
    adds none after warm-up)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compiles_forward(
    model: CausalLM, config: EngineConfig, device: torch.device, attention_backend: str
) -> bool:
    """Compile on a CPU with an attention backend that allows it (``compilable``:
    the reference, where the per-op cost is Python's), unless ``enforce_eager`` or ``PAGED_COMPILE=0`` (the test
    suite sets it: compiling costs seconds per engine). CUDA keeps its
    decode graphs; tensor parallelism stays eager (the ranks run eagerly), and
    so does a model whose forward pass syncs with the host (``graph_safe``)."""
    return (
        model.graph_safe
        and not config.enforce_eager
        and os.environ.get("PAGED_COMPILE", "1") != "0"
        and platform_for(device).compiles_forward
        and attention_backends.backend_class(attention_backend).compilable
        and config.world_size == 1
    )
