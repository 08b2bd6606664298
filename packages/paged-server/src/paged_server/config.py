"""Engine configuration: what the operator chooses, validated before anything is built.

``EngineConfig`` is plain frozen data (the CLI and ``LLM(**kwargs)`` fill
it). ``EngineConfig.resolve`` is the one place its ``"auto"`` and ``None``
settings become concrete choices for this machine and this model: it
returns a ``RunConfig``, the config as run, which is all the engine reads.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from paged_server import attention_backends
from paged_server.models.pooler import CONVERTS, RUNNERS, TASKS, resolve_head
from paged_server.platform import Platform, platform_for, resolve_device
from paged_server.sampling_params import MAX_LOGPROBS
from paged_server.speculative_config import SpeculativeConfig

if TYPE_CHECKING:
    from paged_server.models.config import ModelConfig

log = logging.getLogger(__name__)

KV_CACHE_BACKENDS = ("paged", "contiguous")
ATTENTION_BACKENDS = ("auto", *attention_backends.BACKENDS)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# vLLM's --kv-cache-dtype values (paged_ref.kv_quant.KV_CACHE_DTYPES says what each stores).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
# vLLM's --scheduling-policy values (engine/core/scheduler.py says what each does).
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything that shapes one engine: cache layout, budgets, backends.

    ``max_num_batched_tokens=None`` picks a budget for the device (see
    ``_token_budget``); the ``RunConfig`` records the one used.
    ``num_gpu_blocks=None`` sizes the paged pool from ``kv_cache_memory_bytes``
    when given, else to ``max_batch_size * max_model_len / block_size`` blocks:
    the same token capacity as the contiguous pool, for like-for-like
    comparisons. ``gpu_memory_utilization`` sizes it from device memory
    instead (default 0.9 on CUDA; on CPU a share of the available RAM, only
    when set; see ``engine/kv/kv_sizing.py``). The contiguous pool always has fixed ``max_model_len`` rows;
    with ``kv_cache_memory_bytes`` it gets as many rows as fit (at most
    ``max_batch_size``). ``kv_cache_dtype`` (``auto`` = the model's dtype,
    ``fp8``/``fp8_e4m3``, ``fp8_e5m2``, ``int8``) is what both pools store;
    pools are sized in bytes, so an 8-bit cache holds about twice the tokens
    of a 16-bit one in the same ``kv_cache_memory_bytes``.
    ``calculate_kv_scales`` (8-bit ``kv_cache_dtype`` only, as vLLM's) gives
    the cache static scales per (layer, kv head) from one calibration pass
    at start-up: int8 then keeps no per-token scales (exactly 2x the tokens
    of 16 bits) and fp8 uses its range instead of a scale of 1.
    """

    model: str | None = None
    kv_cache_backend: str = "paged"
    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None  # None: 0.9 on CUDA, off on CPU
    max_batch_size: int = 64
    max_num_batched_tokens: int | None = None  # None: by device, see _token_budget
    # None: the model's max_position_embeddings (see _model_len)
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # True: one page table for every layer even when some slide (no block freed early).
    disable_hybrid_kv_cache_manager: bool = False
    enable_chunked_prefill: bool = True
    # > 0: at most this many of one prompt's tokens per step (vLLM's name; 0: off)
    long_prefill_token_threshold: int = 0
    attention_backend: str = "auto"
    enforce_eager: bool = False  # no torch.compile (CPU), no CUDA graphs (CUDA)
    # Make the text of step N's tokens while step N+1's forward pass runs: a
    # GPU's pass is asynchronous, so that host work leaves its critical path;
    # outputs then come one step later. A CPU's pass is not: off there.
    async_output_proc: bool = False
    # vLLM's --async-scheduling: plan step N+1 and process step N's outputs
    # while step N's forward pass runs. None: on where it helps (CUDA, whose
    # pass runs asynchronously); off on a CPU, whose pass holds the cores.
    async_scheduling: bool | None = None
    # vLLM's --speculative-config (a JSON object; speculative_config.py says which keys)
    speculative_config: dict[str, Any] | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    device: str = "auto"
    max_queue_len: int = 1024
    # vLLM's --scheduling-policy: fcfs, or priority (a request's priority field; lower first)
    scheduling_policy: str = "fcfs"
    seed: int = 0
    tensor_parallel_size: int = 1  # >1: that many processes, one per device (parallel/)
    # >1: the layers split into that many stages, each tensor_parallel_size ranks (parallel/)
    pipeline_parallel_size: int = 1
    # Several nodes (torchrun's flag names): this engine is rank 0 on node 0; the
    # other nodes run `paged-server worker` (parallel/node_worker.py).
    nnodes: int = field(default=1, metadata={"help": "nodes the ranks (tensor_parallel_size x "
        "pipeline_parallel_size) span (each runs an equal share, stage by stage); start `paged-server worker --node-rank N` on "
        "the others. Under torchrun the ranks come from its RANK/WORLD_SIZE instead"})
    # >1: that many engine replicas, each its own process (and its own tensor and
    # pipeline ranks), behind one API server (data_parallel/); one node only.
    data_parallel_size: int = 1
    master_addr: str = field(default="127.0.0.1", metadata={"help": "with --nnodes > 1: the "
        "address of this node the other nodes reach (the rendezvous store listens on the port)"})
    master_port: int = field(default=29500, metadata={"help": "with --nnodes > 1: the "
        "rendezvous store's TCP port (torchrun's default)"})
    # None: the checkpoint's own format (dense, or its quantization_config); see
    # models/quantization/methods.py for the names (vLLM's --quantization).
    quantization: str | None = None
    # vLLM's names, below: what a `vllm serve` launch line sets.
    max_logprobs: int = MAX_LOGPROBS  # most logprobs/prompt_logprobs a request may ask for (-1: vocab)
    tokenizer: str | None = None  # tokenizer directory when not the model's
    generation_config: str = "auto"  # "auto": the model's sampling defaults; "vllm": none; or a directory
    override_generation_config: dict[str, Any] | None = None  # on top of generation_config
    disable_sliding_window: bool = False  # full attention, max_model_len capped at the window
    # KV cache tiers behind the prefix cache (engine/kv/kv_tiers.py): host memory in GiB
    # (vLLM's name; the total over tensor-parallel ranks), a disk folder kept across restarts.
    kv_offloading_size: float | None = None
    kv_disk_dir: str | None = None
    kv_disk_size: float | None = None  # GiB; None: 10 with --kv-disk-dir
    # Pooling models (models/pooler.py): vLLM's --runner / --convert, the older
    # --task, and --pooler-config over the checkpoint's own pooling.
    runner: str = "auto"
    convert: str = "auto"
    task: str | None = None
    pooler_config: dict[str, Any] | None = None
    # LoRA adapters (models/lora, vLLM's LoRAConfig): --enable-lora makes every
    # projection's slot table at start-up; adapters come with --lora-modules,
    # at run time, or with each offline request.
    enable_lora: bool = False
    max_loras: int = 1  # adapters in one step (device slots)
    max_lora_rank: int = 16  # each slot's rank: an adapter of a higher rank is refused
    max_cpu_loras: int | None = None  # adapters kept read in host memory (None: max_loras)

    def resolve(
        self,
        model_config: ModelConfig,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        checkpoint_dtype: str | None = None,
    ) -> RunConfig:
        """This config as run for ``model_config``: validated, with every
        ``auto`` and ``None`` the engine reads made concrete (device, dtype,
        attention backend, ``max_model_len``, token budget). ``device`` and
        ``dtype``: those of a model already loaded; else they come from this
        config, and ``dtype="auto"`` from ``checkpoint_dtype`` (the name
        config.json gives, ``models.loader.checkpoint_dtype``). Raises
        ``ValueError`` naming the setting that cannot run here."""
        self.validate()
        _check_gguf_tokenizer(self)
        max_model_len, one_page_table = _model_len(self, model_config)
        _check_max_model_len(max_model_len, model_config.max_position_embeddings)
        device = device if device is not None else resolve_device(self.device)
        platform = platform_for(device)
        dtype = dtype if dtype is not None else _dtype(self, platform, checkpoint_dtype)
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineConfig)}
        pooling = resolve_head(model_config.architecture, self.runner, self.convert, self.task)
        return RunConfig(**{
            **given,
            "max_model_len": max_model_len,
            "disable_hybrid_kv_cache_manager": one_page_table,
            "max_num_batched_tokens": _token_budget(self, max_model_len, platform),
            "device": str(device),
            "dtype": str(dtype).removeprefix("torch."),
            "dtype_reason": _dtype_reason(self, platform, dtype),
            "attention_backend": attention_backends.resolve(
                self.attention_backend, platform.device_type, self.kv_cache_dtype, self.block_size
            ),
            # the tiers fetch disk blocks between steps: never while a pass runs;
            # a pooling request samples nothing to overlap with: the plain step
            "async_scheduling": pooling is None and (
                platform.async_scheduling_by_default and not self.uses_kv_tiers
                if self.async_scheduling is None else self.async_scheduling
            ),
            "pooling": pooling,
        })

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field and what to do."""
        _choice("kv_cache_backend", self.kv_cache_backend, KV_CACHE_BACKENDS)
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _choice("dtype", self.dtype, ("auto", *DTYPES))
        _choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _choice("runner", self.runner, RUNNERS)
        _choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        _choice("convert", self.convert, CONVERTS)
        if self.task is not None:
            _choice("task", self.task, tuple(TASKS))
        self._check_kv_scales()
        if self.speculative_config is not None:
            SpeculativeConfig.parse(self.speculative_config)
        if self.quantization is not None:
            from paged_server.models.quantization.methods import QUANTIZATION_METHODS

            _choice("quantization", self.quantization, QUANTIZATION_METHODS)
        if not (self.device in ("auto", "cpu", "cuda") or str(self.device).startswith("cuda:")):
            raise ValueError(
                f"device: must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}"
            )
        for name in ("block_size", "max_batch_size", "max_queue_len", "tensor_parallel_size",
                     "pipeline_parallel_size", "nnodes", "data_parallel_size"):  # fmt: skip
            _at_least(name, getattr(self, name), 1)
        if self.max_model_len is not None:
            _at_least("max_model_len", self.max_model_len, 2)  # one prompt token + one generated
        for name in ("num_gpu_blocks", "kv_cache_memory_bytes", "max_num_batched_tokens"):
            if getattr(self, name) is not None:
                _at_least(name, getattr(self, name), 1)
        share = self.gpu_memory_utilization
        if share is not None and (
            isinstance(share, bool)
            or not isinstance(share, int | float)
            or not 0.0 < share <= 1.0
        ):
            raise ValueError(
                f"gpu_memory_utilization: must be a fraction in (0, 1], got {share!r}"
            )
        if not _is_int(self.max_logprobs) or self.max_logprobs < -1:
            raise ValueError(
                f"max_logprobs: must be an integer >= -1 (-1: the whole vocabulary), got {self.max_logprobs!r}"
            )
        if self.override_generation_config is not None and not isinstance(
            self.override_generation_config, dict
        ):
            raise ValueError(
                "override_generation_config: must be a JSON object such as "
                f'{{"temperature": 0.5}}, got {self.override_generation_config!r}'
            )
        if self.world_size % self.nnodes:
            raise ValueError(
                f"nnodes: {self._world_text()} must be a multiple of "
                f"nnodes ({self.nnodes}), every node runs the same number of ranks"
            )
        self._check_pipeline()
        self._check_data_parallel()
        self._check_kv_tiers()
        self._check_lora()
        if not (_is_int(self.master_port) and 0 <= self.master_port <= 65535):
            raise ValueError(f"master_port: must be in 0..65535, got {self.master_port!r}")
        if not _is_int(self.seed):
            raise ValueError(f"seed: must be an integer, got {self.seed!r}")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"model: must be a path string or None, got {self.model!r}")
        if not (_is_int(self.long_prefill_token_threshold) and self.long_prefill_token_threshold >= 0):
            raise ValueError(
                "long_prefill_token_threshold: must be an integer >= 0 (0: off), got "
                f"{self.long_prefill_token_threshold!r}"
            )
        if self.max_num_batched_tokens is None:
            return
        if self.max_num_batched_tokens < self.max_batch_size:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_batch_size ({self.max_batch_size}) so every running sequence can "
                "decode in one step; raise it or lower max_batch_size"
            )
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) when enable_chunked_prefill is False, "
                "or long prompts could never be scheduled; enable chunked prefill or raise it"
            )

    @property
    def world_size(self) -> int:
        """Ranks in all: ``tensor_parallel_size * pipeline_parallel_size``."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _world_text(self) -> str:
        if self.pipeline_parallel_size == 1:
            return f"tensor_parallel_size ({self.tensor_parallel_size})"
        return (
            f"the ranks ({self.world_size} = tensor_parallel_size {self.tensor_parallel_size} x "
            f"pipeline_parallel_size {self.pipeline_parallel_size})"
        )

    def _check_pipeline(self) -> None:
        """What pipeline parallelism cannot run with, refused in one line."""
        if self.pipeline_parallel_size == 1:
            return
        if self.kv_cache_backend != "paged":
            raise ValueError(
                "pipeline_parallel_size > 1 needs kv_cache_backend='paged' (each stage's pool "
                "holds its own layers of the same blocks); drop --kv-cache-backend contiguous"
            )

    @property
    def uses_kv_tiers(self) -> bool:
        """Whether a host-memory or disk tier keeps evicted prefix blocks."""
        return bool(self.kv_offloading_size) or self.kv_disk_dir is not None

    def _check_kv_tiers(self) -> None:
        """The KV tiers' sizes, and what they do not combine with, in one line."""
        for name in ("kv_offloading_size", "kv_disk_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value < 0):
                raise ValueError(f"{name}: must be a size in GiB >= 0, got {value!r}")
        if self.kv_disk_size is not None and self.kv_disk_dir is None:
            raise ValueError("kv_disk_size: set --kv-disk-dir DIR too (the folder the disk tier writes)")
        if not self.uses_kv_tiers:
            return
        flag = "--kv-offloading-size" if self.kv_offloading_size else "--kv-disk-dir"
        if self.kv_cache_backend != "paged":
            raise ValueError(f"{flag}: the KV tiers keep paged blocks; drop it or use --kv-cache-backend paged")
        if self.async_scheduling:
            raise ValueError(f"{flag}: the KV tiers run with --no-async-scheduling (disk blocks are "
                             "fetched between steps); drop --async-scheduling")  # fmt: skip

    def _check_lora(self) -> None:
        """vLLM's LoRA limits, and what adapters do not run with yet, in one line."""
        for name in ("max_loras", "max_lora_rank"):
            _at_least(name, getattr(self, name), 1)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        if not self.enable_lora:
            return
        if self.pipeline_parallel_size > 1:
            raise ValueError("--enable-lora runs with tensor parallelism (-tp), not pipeline "
                             "stages yet; drop -pp or --enable-lora")  # fmt: skip
        if self.data_parallel_size > 1:
            raise ValueError("--enable-lora serves one engine, not data-parallel replicas yet; "
                             "drop --data-parallel-size or --enable-lora")  # fmt: skip
        if self.quantization is not None:
            raise ValueError(f"--enable-lora: adapters on quantized weights (--quantization "
                             f"{self.quantization}) are not supported; serve the unquantized checkpoint")  # fmt: skip

    def _check_data_parallel(self) -> None:
        """What data parallelism does not combine with yet, refused in one line."""
        if self.data_parallel_size == 1:
            return
        if self.nnodes > 1:
            raise ValueError(
                "data_parallel_size > 1 runs its replicas on this node: drop --nnodes, or run one "
                "server per node behind an HTTP load balancer (docs/parallelism.md)"
            )

    def _check_kv_scales(self) -> None:
        if not isinstance(self.calculate_kv_scales, bool):
            raise ValueError(
                f"calculate_kv_scales: must be True or False, got {self.calculate_kv_scales!r}"
            )
        if not self.calculate_kv_scales:
            return
        if self.kv_cache_dtype == "auto":
            raise ValueError(
                "calculate_kv_scales: applies to kv_cache_dtype "
                f"{', '.join(d for d in KV_CACHE_DTYPES if d not in ('auto', 'int4'))}, not 'auto' "
                "(the model dtype needs no scales); set --kv-cache-dtype or drop the flag"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig(EngineConfig):
    """An ``EngineConfig`` as run, built once by ``EngineConfig.resolve``:
    ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``), ``dtype`` and
    ``attention_backend`` name concrete choices, never ``auto``;
    ``max_model_len`` and ``max_num_batched_tokens`` are numbers."""

    max_model_len: int
    max_num_batched_tokens: int
    dtype_reason: str = ""  # why "auto" chose dtype, for the start-up line
    pooling: str | None = None  # the pooling head run (embed/classify), None: generation

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """``speculative_config`` parsed (None: no speculation)."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.parse(self.speculative_config)

    def summary(self) -> str:
        """Every setting as ``name=value``, for the one log line at start-up."""
        return " ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))


def _model_len(config: EngineConfig, model_config: ModelConfig) -> tuple[int, bool]:
    """``(max_model_len, disable_hybrid_kv_cache_manager)``: the length as
    given, else the model's ``max_position_embeddings`` (as vLLM).
    ``disable_sliding_window`` caps it at the model's window (within it,
    windowed attention is full attention) and keeps every layer's blocks in
    one page table."""
    length, window = config.max_model_len, model_config.sliding_window
    positions = model_config.max_position_embeddings
    if config.disable_sliding_window and window is not None:
        if length is not None and length > window:
            raise ValueError(
                f"max_model_len: {length} is more than the model's sliding window "
                f"{window}; with disable_sliding_window the context is capped at the "
                "window: lower --max-model-len or drop --disable-sliding-window"
            )
        return min(length or positions, window), True
    return (positions if length is None else length), config.disable_hybrid_kv_cache_manager


# vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN: run past the model's trained length on purpose.
ALLOW_LONG_MAX_MODEL_LEN_ENV = "PAGED_ALLOW_LONG_MAX_MODEL_LEN"


def _check_max_model_len(max_model_len: int, max_position_embeddings: int) -> None:
    """Refuse a ``max_model_len`` beyond the model's ``max_position_embeddings``
    (as vLLM does): past its trained length a model's output degrades. With
    ``PAGED_ALLOW_LONG_MAX_MODEL_LEN=1`` it only warns."""
    if max_model_len <= max_position_embeddings:
        return
    if os.environ.get(ALLOW_LONG_MAX_MODEL_LEN_ENV, "").lower() in ("1", "true"):
        log.warning(
            "max_model_len %d exceeds the model's max_position_embeddings %d (allowed by %s)",
            max_model_len, max_position_embeddings, ALLOW_LONG_MAX_MODEL_LEN_ENV,
        )
        return
    raise ValueError(
        f"max_model_len: {max_model_len} is more than the model's max_position_embeddings "
        f"{max_position_embeddings} (the longest context it was trained on); lower "
        f"--max-model-len, or set {ALLOW_LONG_MAX_MODEL_LEN_ENV}=1 to run past it anyway "
        "(output quality degrades)"
    )


# Step token budget when none is given. On a GPU a step costs about the same
# up to thousands of tokens, so big chunks are nearly free. On a CPU a step
# costs in proportion to its tokens: 256 prompt tokens beside the decodes
def _token_budget(config: EngineConfig, max_model_len: int, platform: Platform) -> int:
    """The configured budget, or the device's default; never below
    ``max_batch_size`` (every running sequence must be able to decode in one
    step) nor, without chunked prefill, below ``max_model_len`` (whole prompts)."""
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens
    budget = platform.default_batched_tokens
    if not config.enable_chunked_prefill:
        budget = max(budget, max_model_len)
    return max(budget, config.max_batch_size)


def _check_gguf_tokenizer(config: EngineConfig) -> None:
    """A GGUF model whose own tokenizer cannot be rebuilt needs ``--tokenizer``:
    refused before loading (models/gguf_tokenizer.py says which ones)."""
    from paged_server.models.gguf import GGUFFile, is_gguf

    if config.tokenizer is not None or config.model is None or not is_gguf(config.model):
        return
    from paged_server.models.gguf_tokenizer import unsupported_reason

    if (reason := unsupported_reason(GGUFFile(config.model))) is not None:
        raise ValueError(f"tokenizer: {reason}")


def _dtype(config: EngineConfig, platform: Platform, checkpoint_dtype: str | None) -> torch.dtype:
    """``auto`` is from the checkpoint's dtype (config.json's ``torch_dtype``
    / ``dtype``) as the platform runs it (``Platform.default_dtype``: as
    vLLM on CUDA; bfloat16 or float32 on a CPU by its bf16 matrix units).
    Softmax and logits stay float32 either way."""
    if config.dtype != "auto":
        return DTYPES[config.dtype]
    return platform.default_dtype(checkpoint_dtype)


def _dtype_reason(config: EngineConfig, platform: Platform, dtype: torch.dtype) -> str:
    """Why ``auto`` chose ``dtype``, for the start-up line ("" when it was set)."""
    if config.dtype != "auto":
        return ""
    return platform.dtype_reason(dtype)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _at_least(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: must be an integer >= {low}, got {value!r}")


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}: must be one of {', '.join(map(repr, allowed))}, got {value!r}")
