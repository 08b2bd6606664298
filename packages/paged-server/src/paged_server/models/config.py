"""One model configuration for every family, read from a Hugging Face config.json.

Hugging Face configs changed shape over the years (``rope_scaling`` +
``rope_theta`` before transformers 5, ``rope_parameters`` after; Gemma 3's
``sliding_window_pattern`` before ``layer_types``). ``ModelConfig.from_hf``
accepts both so that any checkpoint on disk loads, and model code reads one
normalized dataclass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from paged_server.models.errors import InvalidConfigError

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "su")
# Families whose config.json ``sliding_window`` applies to every layer (transformers).
_WINDOW_ON_EVERY_LAYER = ("mistral", "mixtral", "phi3")


@dataclass(slots=True)
class RopeParams:
    """Rotary embedding parameters for one kind of layer.

    ``rope_type`` is ``default`` (plain RoPE), ``linear`` (positions divided
    by ``factor``), ``llama3`` (Llama 3.1's frequency-dependent scaling) or
    ``longrope`` (Phi-3's: per-frequency ``short_factor`` below
    ``original_max_position_embeddings``, ``long_factor`` from there on, and
    cos/sin scaled by ``attention_factor``; ``su`` is its older name).
    """

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    short_factor: list[float] | None = None
    long_factor: list[float] | None = None
    attention_factor: float | None = None
    # llama.cpp's rope_freqs: each frequency divided by its factor (a GGUF's Llama 3 scaling)
    freq_factors: list[float] | None = None


@dataclass(slots=True)
class ModelConfig:
    """The shape and behaviour of a decoder-only model, family-independent.

    ``layer_types[i]`` is ``full_attention`` or ``sliding_attention``;
    ``layer_sliding_window(i)`` gives the window a layer's attention uses.
    ``local_rope`` is the second RoPE (Gemma 3's sliding layers), else None.
    ``qkv_bias``: q/k/v carry a bias (Qwen 2 without ``attention_bias``,
    which adds one to the output projection too). With ``num_experts`` > 0
    the layers ``layer_is_moe`` names run a mixture of experts of
    ``moe_intermediate_size`` each, ``num_experts_per_tok`` per token.
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeParams
    local_rope: RopeParams | None = None
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qkv_bias: bool = False
    mlp_bias: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: list[bool] = field(default_factory=list)

    def layer_is_moe(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` runs the experts (else a dense MLP)."""
        return bool(self.moe_layers) and self.moe_layers[layer_idx]

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The attention window of layer ``layer_idx`` (None: full attention)."""
        if self.layer_types[layer_idx] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    @property
    def layer_sliding_windows(self) -> list[int | None]:
        """Per-layer windows, e.g. for a pool that frees blocks outside every window."""
        return [self.layer_sliding_window(i) for i in range(self.num_layers)]

    @classmethod
    def from_hf(cls, hf: dict[str, Any], architecture: str) -> ModelConfig:
        """Normalize a Hugging Face config dict (the text part for multimodal
        checkpoints) into a ``ModelConfig``."""
        try:
            return _from_hf(hf, architecture)
        except KeyError as exc:
            raise InvalidConfigError(
                f"config.json has no {exc.args[0]!r} field, which a {architecture} model needs; "
                "is this a complete Hugging Face model directory?"
            ) from None


def _from_hf(hf: dict[str, Any], architecture: str) -> ModelConfig:
    model_type = hf.get("model_type", "")
    num_layers = int(hf["num_hidden_layers"])
    num_heads = int(hf["num_attention_heads"])
    hidden_size = int(hf["hidden_size"])
    is_gemma3 = model_type.startswith("gemma3")
    head_dim = hf.get("head_dim") or hidden_size // num_heads
    layer_types = _layer_types(hf, num_layers, model_type)
    sliding_window = hf.get("sliding_window") if SLIDING_ATTENTION in layer_types else None
    if SLIDING_ATTENTION in layer_types and not sliding_window:
        raise InvalidConfigError("config.json has sliding_attention layers but no sliding_window")
    rope, local_rope = _rope(hf, is_gemma3)
    hidden_act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    attention_bias = bool(hf.get("attention_bias", False))
    num_experts = int(hf.get("num_local_experts") or hf.get("num_experts") or 0)
    return ModelConfig(
        architecture=architecture,
        model_type=model_type,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=rope,
        local_rope=local_rope,
        sliding_window=int(sliding_window) if sliding_window else None,
        layer_types=layer_types,
        hidden_act=str(hidden_act),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", is_gemma3)),
        attention_bias=attention_bias,
        qkv_bias=bool(hf.get("qkv_bias", attention_bias)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        query_pre_attn_scalar=_opt_float(hf.get("query_pre_attn_scalar")),
        attn_logit_softcapping=_opt_float(hf.get("attn_logit_softcapping")),
        final_logit_softcapping=_opt_float(hf.get("final_logit_softcapping")),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_as_id_list(hf.get("eos_token_id")),
        torch_dtype=hf.get("dtype") or hf.get("torch_dtype"),
        num_experts=num_experts,
        num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(
            hf.get("moe_intermediate_size") or hf["intermediate_size"] if num_experts else 0
        ),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        moe_layers=_moe_layers(hf, num_layers, num_experts),
    )


def _moe_layers(hf: dict[str, Any], num_layers: int, num_experts: int) -> list[bool]:
    """Which layers run experts: all (Mixtral), or Qwen 3 MoE's every
    ``decoder_sparse_step``-th layer outside ``mlp_only_layers``."""
    if not num_experts:
        return []
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or [])
    return [i not in dense and (i + 1) % step == 0 for i in range(num_layers)]


def _layer_types(hf: dict[str, Any], num_layers: int, model_type: str) -> list[str]:
    """Which layers use a sliding window, from ``layer_types`` or older fields."""
    types = hf.get("layer_types")
    if types is None and model_type == "gemma2":
        # Before layer_types: even layers slide, odd ones are global.
        types = [FULL_ATTENTION if i % 2 else SLIDING_ATTENTION for i in range(num_layers)]
    elif types is None and model_type in _WINDOW_ON_EVERY_LAYER and hf.get("sliding_window"):
        types = [SLIDING_ATTENTION] * num_layers
    elif types is None and model_type.startswith("gemma3"):
        # Before layer_types: every `pattern`-th layer is global, the rest slide.
        pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
        types = [
            SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers)
        ]
    elif types is None and hf.get("use_sliding_window") and hf.get("sliding_window"):
        # Qwen2/3 style: layers from max_window_layers on use the window.
        first = int(hf.get("max_window_layers", 0))
        types = [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(num_layers)]
    elif types is None:
        types = [FULL_ATTENTION] * num_layers
    if hf.get("use_sliding_window") is False:
        types = [FULL_ATTENTION] * num_layers  # Qwen3 lists layer types but may disable windows
    types = list(types)
    if len(types) != num_layers:
        raise InvalidConfigError(
            f"config.json lists {len(types)} layer_types but num_hidden_layers is {num_layers}"
        )
    unknown = sorted(set(types) - {FULL_ATTENTION, SLIDING_ATTENTION})
    if unknown:
        raise InvalidConfigError(f"config.json has unsupported layer_types {unknown}")
    return types


def _rope(hf: dict[str, Any], is_gemma3: bool) -> tuple[RopeParams, RopeParams | None]:
    """Global (and Gemma 3 local) RoPE parameters, old or new config format."""
    params = hf.get("rope_parameters")
    if is_gemma3:
        per_type = params if isinstance(params, dict) and FULL_ATTENTION in params else {}
        full = dict(per_type.get(FULL_ATTENTION) or {})
        local = dict(per_type.get(SLIDING_ATTENTION) or {})
        full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
        local.setdefault("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
        if hf.get("rope_scaling"):
            full.update(hf["rope_scaling"])  # old format: scaling applies to global layers only
        return _rope_params(full), _rope_params(local)
    merged = dict(params or {})
    merged.setdefault("rope_theta", hf.get("rope_theta", 10_000.0))
    if hf.get("rope_scaling"):
        merged.update(hf["rope_scaling"])
    if merged.get("rope_type", merged.get("type")) in ("longrope", "su"):
        # Phi-3 keeps these at the top level; the scale defaults to the context ratio.
        orig = merged.setdefault(
            "original_max_position_embeddings", hf.get("original_max_position_embeddings")
        )
        if not orig:
            raise InvalidConfigError("longrope needs original_max_position_embeddings")
        if merged.get("factor") is None:
            merged["factor"] = int(hf.get("max_position_embeddings", orig)) / int(orig)
    return _rope_params(merged), None


def _rope_params(d: dict[str, Any]) -> RopeParams:
    rope_type = d.get("rope_type") or d.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise InvalidConfigError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    rope_type = "longrope" if rope_type == "su" else rope_type
    if float(d.get("partial_rotary_factor", 1.0)) != 1.0:
        raise InvalidConfigError("partial_rotary_factor != 1 is not supported")
    orig = d.get("original_max_position_embeddings")
    return RopeParams(
        theta=float(d["rope_theta"]),
        rope_type=rope_type,
        factor=float(d.get("factor", 1.0)),
        low_freq_factor=float(d.get("low_freq_factor", 1.0)),
        high_freq_factor=float(d.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(orig) if orig else None,
        short_factor=_opt_floats(d.get("short_factor")),
        long_factor=_opt_floats(d.get("long_factor")),
        attention_factor=_opt_float(d.get("attention_factor")),
    )


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _opt_floats(value: Any) -> list[float] | None:
    return None if value is None else [float(v) for v in value]


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
