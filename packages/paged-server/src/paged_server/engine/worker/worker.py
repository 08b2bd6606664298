"""One rank's worker: its model shard, its KV cache tensors, its forward pass. The same on every rank.

The engine core (``LLMEngine``: requests, scheduling, the KV cache manager,
sampling, outputs) never touches weights or KV tensors; the worker never
sees a request. Between them go ``WorkerStep``s: one flat forward pass as
token ids, the KV cache manager's ``StepLayout`` (page tables, positions,
block copies) and the token rows whose logits the core needs. An executor
(``engine/core/executor.py``; ``parallel/executor.py`` for several ranks) calls
the same methods on every rank's worker in the same order, rank 0's in
the engine's own process, so the ranks' collectives always meet:

1. ``load_model``: this rank's shard (its kv heads with tensor parallelism,
   its stage's layers with pipeline parallelism);
2. ``calibrate``: ``calculate_kv_scales``' pass, each rank over its own heads;
3. ``available_blocks``: what this rank's memory holds, the least over the ranks;
4. ``init_cache``: the KV tensors from the one ``KVCacheSpec``, the decode
   graphs (CUDA) or the compiled forward (CPU), the pipeline stage;
5. ``warm_up``: compile and capture before the first request, within the cache;
6. ``execute``: each step. Rank 0 returns the logits of the step's rows
   (with pipeline parallelism they come from the last stage); the others None.

With ``--enable-lora`` each rank holds a ``LoRAManager`` over its shard
(``models/lora``). Adapters are added and removed by commands riding the
step (``WorkerStep.lora_ops``), so every rank applies them in the same
order as the steps, never while a pass runs; a step whose sequences use
adapters (``WorkerStep.loras``) runs its forward with their
``LoRAMapping``: through the compiled CPU forward's graphs for steps with
adapters (the delta an opaque op), eagerly instead of a CUDA graph.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from paged_core.kv_cache_groups import kv_cache_groups
from paged_ref.attention_metadata import AttentionMetadata
from paged_ref.cache_view import CacheView
from paged_ref.kv_spec import KVCacheSpec
from paged_ref.kv_tensors import KVCacheTensors
from paged_ref.kv_tier_files import fingerprint
from paged_ref.kv_tier_store import KVTierStore
from paged_ref.step_layout import StepLayout
from paged_server import attention_backends
from paged_server.config import RunConfig
from paged_server.engine.kv.kv_calibration import KVScales, calibrated_kv_scales
from paged_server.engine.kv.kv_tiers import cache_identity
from paged_server.engine.kv.pool_factory import cache_size
from paged_server.engine.worker.compiled_forward import (
    ROW_BUCKET,
    CompiledForward,
    compiles_forward,
    padded_rows,
    row_buckets,
)
from paged_server.engine.worker.decode_graphs import DecodeGraphs
from paged_server.engine.worker.kernel_warmup import warm_up_kernels
from paged_server.models import LoadedModel, load_model
from paged_server.models.errors import LoRAAdapterError
from paged_server.models.layers import use_layer_ops
from paged_server.models.linear import attach_few_row_weights
from paged_server.models.lora import LoRAConfig, LoRAManager, LoRAMapping
from paged_server.models.pipeline_parallel import PipelineStage, stage_layers
from paged_server.models.tensor_parallel import SINGLE, TensorParallel, shard_heads
from paged_server.platform import platform_for

if TYPE_CHECKING:
    from paged_server.parallel.process_groups import TPGroup

log = logging.getLogger(__name__)

# Debugging and CPU proofs: "eager" runs the decode graphs' static path
# without capturing, on any device; "check" refuses what a graph cannot replay.
DECODE_GRAPHS_ENV = "PAGED_DECODE_GRAPHS"


@dataclass(slots=True)
class WorkerStep:
    """One forward pass, as every rank's worker runs it: ``input_ids`` of
    the flat batch (sequence after sequence, as ``layout`` lays them out);
    ``rows``: the token rows whose logits rank 0 returns, in that order
    (``every_row``: they are all the rows, in order, so no gather)."""

    input_ids: list[int]
    layout: StepLayout
    rows: list[int]
    every_row: bool = False
    # Each sequence's LoRA adapter in batch order (None: the base model);
    # None when no sequence of the step uses one.
    loras: list[str | None] | None = None
    # Adapter commands to apply first, in order: ("add", name, path), ("remove", name).
    lora_ops: list[tuple[str, ...]] = field(default_factory=list)

    @property
    def is_decode(self) -> bool:
        """One token per sequence (what CUDA graphs replay)."""
        return len(self.input_ids) == len(self.layout.starts)


class Worker:
    """One rank's model and KV cache (see module doc). ``group``: the
    process groups of a parallel engine (None: one rank); ``loaded``: a
    model already in memory (rank 0 of a one-rank engine only)."""

    def __init__(
        self,
        config: RunConfig,
        *,
        rank: int = 0,
        group: TPGroup | None = None,
        device: torch.device | None = None,
        micro_batches: int = 1,
        loaded: LoadedModel | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.group = group
        self.device = device if device is not None else config.torch_device
        self.platform = platform_for(self.device)  # what this device type does (platform.py)
        self.micro_batches = micro_batches
        self.loaded = loaded
        self.kv_scales: KVScales | None = None
        self.tensors: KVCacheTensors | None = None
        self.graphs: DecodeGraphs | None = None
        self.compiled: CompiledForward | None = None
        self.pipeline: Any = None  # parallel.pipeline.PipelineStep, with pipeline parallelism
        self.tier_store: KVTierStore | None = None  # --kv-offloading-size / --kv-disk-dir
        self.lora: LoRAManager | None = None  # --enable-lora
        tp_size = config.tensor_parallel_size
        self.tp = SINGLE if group is None else TensorParallel(rank % tp_size, tp_size, group)
        self.stage = PipelineStage(rank // tp_size, config.pipeline_parallel_size)

    @property
    def is_driver(self) -> bool:
        """Rank 0: the engine's own process, which gets the logits."""
        return self.rank == 0

    # -- 1. the model ------------------------------------------------------------
    def load_model(self, path: str) -> None:
        """Load this rank's shard of the checkpoint at ``path`` (once)."""
        config = self.config
        if self.loaded is None:
            self.loaded = load_model(
                path, config.torch_dtype, self.device, self.tp, config.quantization, pp=self.stage,
                pooling=config.pooling, pooler_config=config.pooler_config,
            )  # fmt: skip
        # The backend's fused norm/RoPE/SiLU kernels where eager ops cost a kernel each (CUDA).
        use_layer_ops(self.model, self._backend().layer_ops(self.platform.device_type))
        if self.platform.device_type == "cpu":  # bf16 projections of 1-8 rows on the C kernel
            attach_few_row_weights(self.model)
        if self.stage.size > 1:  # this rank's turn of each step (calibration's pass included)
            from paged_server.parallel.pipeline import PipelineStep

            assert self.group is not None
            self.pipeline = PipelineStep(
                self.model, self.group, self.loaded.dtype, self.device, config.block_size,
                self.micro_batches,
            )  # fmt: skip
        if config.enable_lora and self.lora is None:  # the slot tables, before sizing the cache
            self.lora = LoRAManager(
                self.model,
                LoRAConfig(config.max_loras, config.max_lora_rank, config.max_cpu_loras),
                self._lora_ops(),
            )

    def _lora_ops(self) -> Any:
        """The LoRA kernels the attention backend runs beside it (None: the reference's)."""
        return self._backend().lora_ops(self.platform.device_type)

    def _backend(self) -> Any:
        """The configured attention backend (its kernels beside attention)."""
        return attention_backends.build(self.config.attention_backend)

    @property
    def model(self) -> Any:
        assert self.loaded is not None, "load_model first"
        return self.loaded.model

    def kv_spec(self) -> KVCacheSpec:
        """This rank's KV cache layout: every KV cache group of the model
        (the page tables are the same on every rank), this rank's kv heads."""
        assert self.loaded is not None, "load_model first"
        config, mc = self.config, self.loaded.config
        paged = config.kv_cache_backend == "paged"
        groups = kv_cache_groups(
            mc.layer_sliding_windows, hybrid=paged and not config.disable_hybrid_kv_cache_manager
        )
        return KVCacheSpec(
            tuple(groups),
            shard_heads(mc.num_heads, mc.num_kv_heads, self.model.tp).num_kv_heads,
            mc.head_dim,
            self.loaded.dtype,
            config.kv_cache_dtype,
            config.block_size if paged else config.max_model_len,
            static_scales=config.calculate_kv_scales,
        )

    def stage_spec(self) -> KVCacheSpec:
        """``kv_spec`` as this rank's pipeline stage stores it (its layers only)."""
        spec = self.kv_spec()
        if self.stage.size == 1:
            return spec
        return spec.for_stage(stage_layers(spec.num_layers, self.stage.rank, self.stage.size))

    # -- 2. calibration ------------------------------------------------------------
    def calibrate(self) -> KVScales | None:
        """``calculate_kv_scales``: one pass over the calibration text through
        a small cache of this rank's (every rank at once: their all-reduces
        and pipeline transfers meet); returns this rank's scales."""
        if not self.config.calculate_kv_scales:
            return None
        assert self.loaded is not None, "load_model first"
        self.kv_scales = calibrated_kv_scales(
            self.config, self.loaded, self.kv_spec().num_kv_heads, self._forward_pass
        )
        log.info("calculate_kv_scales (%s): %s", self.config.kv_cache_dtype, self.kv_scales.summary())
        return self.kv_scales

    # -- 3. sizing -----------------------------------------------------------------
    def available_blocks(self) -> tuple[int, str]:
        """Blocks (rows, for the contiguous cache) this rank's budget holds,
        the null block included, and how they were chosen; the least over
        every rank, so that every rank can hold every block id."""
        num_blocks, sized_by = cache_size(
            self.config, self.stage_spec(), self.device, self.model, self._local_ranks()
        )
        if self.group is not None:
            num_blocks = self.group.min_over_ranks(num_blocks)
        return num_blocks, sized_by

    def _local_ranks(self) -> int:
        """Ranks sharing this rank's memory: a CPU node's, which share its RAM."""
        if not self.platform.ranks_share_host or self.group is None:
            return 1
        return max(1, self.config.world_size // self.config.nnodes)

    # -- 4. the cache and what runs over it -------------------------------------------
    def init_cache(self, num_blocks: int) -> None:
        """The KV tensors (``num_blocks`` blocks, or rows), and what the
        forward pass runs with: decode graphs on CUDA, the compiled pass
        and its C decode kernels on a CPU, this rank's pipeline stage."""
        config, model = self.config, self.model
        paged = config.kv_cache_backend == "paged"
        compile_forward = compiles_forward(model, config, self.device, config.attention_backend)
        backend = attention_backends.build(config.attention_backend, paged=paged, compiled=compile_forward)
        scales = None if self.kv_scales is None else (self.kv_scales.k, self.kv_scales.v)
        self.tensors = KVCacheTensors.allocate(
            self.stage_spec(), num_blocks, self.device, paged=paged, ops=backend, kv_scales=scales
        )
        self.compiled = CompiledForward(model) if compile_forward else None
        self.graphs = self._decode_graphs()

    def _decode_graphs(self) -> DecodeGraphs | None:
        """CUDA graphs for pure-decode steps: on CUDA, with the Triton kernels
        (the reference ops sync with the host), on every rank of a
        tensor-parallel engine (each replays its own after the step's
        message), unless ``enforce_eager``. Not with pipeline stages: a
        stage's pass waits for the previous stage's activations.
        ``PAGED_DECODE_GRAPHS=eager`` runs their static buffers without
        capturing, on any device; ``=check`` also refuses every op a graph
        could not replay (``graph_safety``): how a CPU proves the path."""
        config, mode = self.config, os.environ.get(DECODE_GRAPHS_ENV, "")
        forced = mode in ("eager", "check")
        if (
            config.enforce_eager
            or not self.model.graph_safe  # e.g. the experts' host sync
            or self.stage.size > 1
            or config.kv_cache_backend != "paged"
        ):
            return None
        assert self.tensors is not None
        if not forced and (not self.platform.supports_cuda_graphs or not self.tensors.backend.graph_safe):
            return None
        return DecodeGraphs(
            self.model, self.tensors, self.device, config.max_batch_size,
            -(-config.max_model_len // config.block_size), num_groups=len(self.tensors.groups),
            capture=not forced, check=mode == "check",
        )  # fmt: skip

    # -- 5. warm-up ---------------------------------------------------------------------
    def warm_up(self, longest: int) -> float:
        """Compile what serving will use before the first request; returns
        the seconds it took (0 where nothing compiles: an eager CPU pass).

        On CUDA: every Triton kernel variant, every decode graph, one prefill
        pass. On a CPU with the compiled pass: its one-token graph and every
        padded row count up to a prompt chunk (``row_buckets``: each builds
        oneDNN's matmuls for it), the LM head's up to ``max_batch_size``
        rows and at least ``ROW_BUCKET + 1`` (its few-row graph and its
        dynamic one: a speculative verify step's rows pass the batch size). Throwaway passes over blocks 0.. of the cache, which holds
        nothing yet: no block is taken from the KV cache manager, and a
        pass is never longer than ``longest`` tokens, what one sequence can
        take (``PoolCapacity.longest_prompt``: no real step computes more)."""
        config = self.config
        assert self.tensors is not None, "init_cache first"
        start = time.perf_counter()
        if self.platform.warms_up_kernels:
            if self.tensors.backend.needs_warmup:
                warm_up_kernels(self.model, self.loaded.dtype, self.tensors, config.max_model_len, self.device)  # type: ignore[union-attr]
            longest, head_rows = min(longest, config.max_model_len - 1, 256), 1
        elif self.compiled is not None:
            log.info("compiling the forward pass (torch.compile; --enforce-eager skips this)")
            longest = min(longest, config.max_model_len - 1, config.max_num_batched_tokens, 512)
            # past ROW_BUCKET rows: the head's dynamic graph, not only its few-row one
            head_rows = max(config.max_batch_size, ROW_BUCKET + 1)
        else:
            return 0.0
        if self.graphs is not None:
            with torch.inference_mode():
                self.graphs.capture_all()
        for num_tokens in self._warm_up_sizes(longest):
            self._throwaway_pass(num_tokens, head_rows)
        self.platform.synchronize(self.device)
        seconds = time.perf_counter() - start
        log.info("warm-up done in %.1f s", seconds)
        return seconds

    def _warm_up_sizes(self, longest: int) -> list[int]:
        """The passes to run: ``longest`` tokens, and with the compiled pass
        one of every padded row count below it (largest first: the first
        compiles the multi-row graph), each within ``longest`` tokens."""
        if longest < 1:
            return []
        sizes = [longest]
        if self.compiled is not None:
            top = padded_rows(longest)
            sizes += [n for n in reversed(row_buckets(longest)) if n != top]
        return sizes

    def _throwaway_pass(self, num_tokens: int, head_rows: int) -> None:
        """A prefill of ``num_tokens`` tokens of id 0 over blocks ``0..`` in
        every KV cache group; its K/V land where no sequence lives yet."""
        assert self.tensors is not None
        bs = self.tensors.block_size
        table = np.arange(-(-num_tokens // bs), dtype=np.int32)[None]
        groups = len(self.tensors.groups)
        tables = table if groups == 1 else np.stack([table] * groups)
        step = WorkerStep([0] * num_tokens, StepLayout(tables, [0], [num_tokens]), [])
        with torch.inference_mode():
            ids, view = self._tensor(step.input_ids), self.tensors.view(step.layout)
            hidden = self._forward_pass(ids, view, [])
            if self.compiled is not None and hidden is not None:  # the head's graphs, at this row count
                self.compiled.compute_logits(hidden[: min(num_tokens, head_rows)])
            if self._head_in_graph(num_tokens, None):  # the one-graph head's
                view = self.tensors.view(step.layout)
                self.compiled.logits(ids, view.meta.positions, view)  # type: ignore[union-attr]
            if self.compiled is not None and self.compiled.has_lora:  # the graphs of steps with adapters
                mapping = LoRAMapping.build([num_tokens], [-1], self.device, padded_rows(num_tokens))
                view = self.tensors.view(step.layout)
                self.compiled.hidden_states(ids, view.meta.positions, view, mapping)

    # -- the KV cache tiers (engine/kv/kv_tiers.py) -----------------------------------------
    def init_tiers(self, disk_dir: str | None) -> list[tuple[bytes, tuple[int, ...]]]:
        """This rank's tier store over its KV tensors; returns the valid
        files its disk folder holds (a warm start), oldest first."""
        assert self.tensors is not None, "init_cache first"
        self.tier_store = KVTierStore(self.tensors, fingerprint(cache_identity(self)), disk_dir)
        return self.tier_store.scan()

    def tier_agree(self, keys: list[bytes]) -> list[bool]:
        """Which of rank 0's disk ``keys`` every rank holds too."""
        assert self.tier_store is not None
        own = {key for key, _ in self.tier_store.scan()} if self.rank else set(keys)
        return self._all_ranks([key in own for key in keys])

    def tier_sync(self, commands: list[tuple[Any, ...]]) -> list[bool]:
        """Carry out the tiers' queued commands now (between steps); which
        fetches every rank read back intact."""
        assert self.tier_store is not None
        return self._all_ranks(self.tier_store.apply(commands))

    def _all_ranks(self, oks: list[bool]) -> list[bool]:
        if self.group is None or not oks:
            return oks
        return [bool(v) for v in self.group.min_each([int(ok) for ok in oks])]

    # -- LoRA adapters (models/lora) -------------------------------------------------------
    def check_lora(self, name: str, path: str) -> str | None:
        """Why the adapter at ``path`` cannot be served here (None: it can);
        reads and checks it, keeps nothing (rank 0, before its ``add`` rides a step)."""
        if self.lora is None:
            return "LoRA adapters need the server started with --enable-lora"
        try:
            self.lora.check(name, path)
        except LoRAAdapterError as exc:
            return str(exc)
        return None

    def _apply_lora_ops(self, ops: list[tuple[str, ...]]) -> None:
        assert self.lora is not None, "a LoRA command without --enable-lora"
        for op in ops:
            if op[0] == "add":
                self.lora.add(op[1], op[2])
            elif op[1] in self.lora.names:
                self.lora.remove(op[1])

    def _lora_mapping(self, step: WorkerStep) -> LoRAMapping | None:
        if step.lora_ops:
            self._apply_lora_ops(step.lora_ops)
        if step.loras is None:
            return None
        assert self.lora is not None, "a step with LoRA adapters without --enable-lora"
        rows = padded_rows(len(step.input_ids)) if self.compiled is not None else None
        return self.lora.mapping(step.layout.new_lens, step.loras, rows)

    # -- 6. each step -------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, step: WorkerStep, meta: AttentionMetadata | None = None) -> Tensor | None:
        """Run one step over this rank's shard; rank 0 returns the logits
        ``[len(step.rows), vocab]`` (float32), every other rank None.
        ``meta``: the step's metadata when built ahead (``KVCacheTensors.build``)."""
        tensors = self.tensors
        assert tensors is not None, "init_cache first"
        if step.layout.tier_ops:  # saves and restores, before the pass reads or reuses blocks
            assert self.tier_store is not None
            self.tier_store.apply(step.layout.tier_ops)
        lora = self._lora_mapping(step) if step.lora_ops or step.loras else None
        if meta is None:
            meta = tensors.metadata(step.layout)
        else:
            tensors.make_copies(step.layout)
        ids = self._tensor(step.input_ids)
        graphs = self.graphs
        if lora is None and graphs is not None and step.is_decode and len(step.input_ids) <= graphs.max_size:
            hidden = graphs.run(meta, ids)
        else:
            view = CacheView.over(tensors, meta)
            if self.pipeline is not None:  # the logits come back from the last stage
                return self.pipeline.run(ids, view, step.rows)  # type: ignore[no-any-return]
            if self._head_in_graph(len(step.input_ids), lora) and step.every_row and step.rows:
                return self.compiled.logits(ids, view.meta.positions, view)  # type: ignore[union-attr]
            hidden = self._hidden_states(ids, view.meta.positions, view, lora)
        if not self.is_driver:  # the LM head's rows are rank 0's alone
            return None
        if not step.rows:  # chunks that end no prompt: no logits (and no 0-row graph to compile)
            return hidden.new_empty(0, 0)
        if not step.every_row:  # else the head reads hidden as it is: no copy
            hidden = hidden.index_select(0, self._tensor(step.rows))
        return self._compute_logits(hidden)

    def _head_in_graph(self, rows: int, lora: LoRAMapping | None) -> bool:
        """Whether a step of ``rows`` rows that samples every one runs the
        compiled layers and LM head as one graph (``CompiledForward.logits``)."""
        return self.compiled is not None and lora is None and rows <= ROW_BUCKET

    @torch.inference_mode()
    def greedy(self, step: WorkerStep) -> list[int]:
        """A draft model's pass (speculative decoding, one rank): the argmax
        token of each of ``step.rows``. On the compiled pass, up to
        ``ROW_BUCKET`` tokens run one graph (every row's argmax; the rows
        wanted are picked after)."""
        tensors = self.tensors
        assert tensors is not None and self.pipeline is None, "a draft model runs on one rank"
        if self.compiled is None or len(step.input_ids) > ROW_BUCKET:
            logits = self.execute(step)
            return [] if logits is None or not step.rows else logits.argmax(-1).tolist()  # type: ignore[no-any-return]
        meta = tensors.metadata(step.layout)
        view = CacheView.over(tensors, meta)
        passes = self.compiled.greedy_passes(self._tensor(step.input_ids), meta.positions, [view])
        tokens = passes[:, 0].tolist()
        return tokens if step.every_row else [tokens[row] for row in step.rows]

    @torch.inference_mode()
    def greedy_passes(self, input_ids: list[int], layouts: list[StepLayout]) -> list[list[int]]:
        """``len(layouts)`` one-token passes of the same sequences (a draft
        model's, one rank), each feeding back the argmax of the pass before
        (``input_ids`` first); each sequence's tokens. On the compiled pass,
        up to ``ROW_BUCKET`` sequences run them all in one graph."""
        tensors = self.tensors
        assert tensors is not None and self.pipeline is None, "a draft model runs on one rank"
        rows = len(input_ids)
        if self.compiled is None or rows > ROW_BUCKET:
            out: list[list[int]] = [[] for _ in input_ids]
            ids = input_ids
            for layout in layouts:
                ids = self.greedy(WorkerStep(ids, layout, list(range(rows)), every_row=True))
                for drafted, token in zip(out, ids, strict=True):
                    drafted.append(token)
            return out
        metas = [tensors.metadata(layout) for layout in layouts]
        views = [CacheView.over(tensors, meta) for meta in metas]
        tokens = self.compiled.greedy_passes(self._tensor(input_ids), metas[0].positions, views)
        return tokens.tolist()  # type: ignore[no-any-return]

    def warm_up_greedy(self, passes: int) -> None:
        """Compile ``greedy``'s graphs (one pass) and ``greedy_passes``' for
        ``passes`` passes (1 and ``ROW_BUCKET`` rows) before serving, over blocks 0..
        as ``warm_up`` does: call it before the cache holds anything."""
        if self.compiled is None:
            return
        assert self.tensors is not None, "init_cache first"
        width = -(-(passes + 1) // self.tensors.block_size)  # blocks a row's positions 0..passes take
        for rows in (1, ROW_BUCKET):
            table = np.arange(rows * width, dtype=np.int32).reshape(rows, width)  # blocks 0..
            groups = len(self.tensors.groups)
            tables = table if groups == 1 else np.stack([table] * groups)
            layout = StepLayout(tables, [0] * rows, [1] * rows)
            self.greedy(WorkerStep([0] * rows, layout, list(range(rows)), every_row=True))
            if passes > 1:  # (one pass is greedy's graph) positions 0.. within each row's blocks
                layouts = [StepLayout(tables, [i] * rows, [1] * rows) for i in range(passes)]
                self.greedy_passes([0] * rows, layouts)

    def _forward_pass(self, ids: Tensor, view: Any, rows: list[int]) -> Tensor | None:
        """``ids`` through this rank's layers over ``view`` (the pipeline's
        stages in turn with pipeline parallelism, where it returns rank 0's
        logits of ``rows`` instead of hidden states)."""
        if self.pipeline is not None:
            return self.pipeline.run(ids, view, rows)  # type: ignore[no-any-return]
        return self._hidden_states(ids, view.meta.positions, view)

    def _hidden_states(
        self, ids: Tensor, positions: Tensor, view: CacheView, lora: LoRAMapping | None = None
    ) -> Tensor:
        if self.compiled is not None:
            if lora is None:
                return self.compiled.hidden_states(ids, positions, view)
            return self.compiled.hidden_states(ids, positions, view, lora)
        if lora is None:  # the forward contract without adapters (models/base.py's first three)
            return self.model.hidden_states(ids, positions, view)  # type: ignore[no-any-return]
        return self.model.hidden_states(ids, positions, view, lora=lora)  # type: ignore[no-any-return]

    def _compute_logits(self, hidden: Tensor) -> Tensor:
        if self.compiled is not None:
            return self.compiled.compute_logits(hidden)
        return self.model.compute_logits(hidden)  # type: ignore[no-any-return]

    def _tensor(self, data: list[int]) -> Tensor:
        # through numpy: ~4 us for a step's 256 ids against ~15 for torch.tensor(list)
        return torch.from_numpy(np.array(data, dtype=np.int64)).to(self.device)
