"""``calculate_kv_scales``: static K and V scales per (layer, kv head), from one calibration pass at start-up.

As vLLM's ``--calculate-kv-scales``: before the serving cache exists, the
model runs once over a fixed English text (``CALIBRATION_TEXT``, encoded
with the model's own tokenizer, cut to ``CALIBRATION_TOKENS`` and to
``max_model_len``) through a small pool in the model's dtype; with tensor
or pipeline parallelism every rank at once, each over its own kv heads and
layers. A recording
view around that pool's view notes, in every layer's ``attend``, the
largest ``|k|`` and ``|v|`` of each kv head: K after RoPE (and Qwen's
k-norm), exactly what the cache would store. ``scale = absmax / qmax``
(127 int8, 448 fp8 e4m3, 57344 fp8 e5m2). Same weights and text, same
scales: nothing here is random. Model code is unchanged: it only ever sees
a view.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from paged_core.kv_cache_groups import KVCacheGroup
from paged_core.protocols import AttentionViewProtocol
from paged_ref.kv_quant import cache_dtype_for, head_scales_from_absmax
from paged_ref.kv_spec import KVCacheSpec
from paged_ref.paged_pool import PagedKVPool

if TYPE_CHECKING:
    from paged_server.config import EngineConfig
    from paged_server.models import LoadedModel

CALIBRATION_TOKENS = 256
# Plain English of the kind a served model sees: prose, numbers, code words.
CALIBRATION_TEXT = (
    "The library opened at nine in the morning, and by ten every table near the windows "
    "was taken. Students spread out their notes, a retired engineer read three newspapers "
    "in a row, and two children argued quietly about which dinosaur was the largest. "
    "Outside, the rain had stopped, but the street was still wet and bright.\n\n"
    "A cache keeps recent results close at hand so that the same work is not done twice. "
    "When the cache is full, something must be removed: usually the entry that was used "
    "least recently. Choosing well matters, because a miss costs far more than a hit.\n\n"
    "In 1969, astronauts landed on the Moon and returned safely to Earth. The mission "
    "lasted eight days, three hours and eighteen minutes. Millions of people watched the "
    "first steps on television, and many still remember where they were that evening.\n\n"
    "def average(values):\n    return sum(values) / len(values)\n\n"
    "Q: What is the capital of France?\nA: Paris is the capital of France, and it is also "
    "its largest city. The river Seine runs through its centre.\n\n"
    "Good instructions are short and clear. First, read the whole recipe. Second, gather "
    "the ingredients: two cups of flour, one egg, a pinch of salt and a glass of milk. "
    "Third, mix them slowly, and let the batter rest for half an hour before cooking."
)


@dataclass(slots=True)
class KVScales:
    """Static scales ``[num_layers, kv_heads]`` float32 for K and V, and how
    many calibration tokens measured them."""

    k: Tensor
    v: Tensor
    num_tokens: int

    def summary(self) -> str:
        """One line for the start-up log: the scales' range."""
        return (
            f"K scales {float(self.k.min()):.3g}..{float(self.k.max()):.3g}, V scales "
            f"{float(self.v.min()):.3g}..{float(self.v.max()):.3g} over "
            f"{tuple(self.k.shape)} (layers, kv heads) from {self.num_tokens} calibration tokens"
        )


class AbsmaxRecorder:
    """A view that forwards everything to ``view`` and records, per layer
    and kv head, the largest ``|k|`` and ``|v|`` that ``attend`` writes."""

    def __init__(
        self, view: AttentionViewProtocol, num_layers: int, kv_heads: int, device: torch.device
    ) -> None:
        self.view = view
        self.k_absmax = torch.zeros(num_layers, kv_heads, dtype=torch.float32, device=device)
        self.v_absmax = torch.zeros_like(self.k_absmax)

    @property
    def seq_len(self) -> int:
        return self.view.seq_len

    @property
    def meta(self) -> Any:
        """The wrapped view's step metadata (a pipeline stage cuts the step by it)."""
        return self.view.meta  # type: ignore[attr-defined]

    def is_paged(self) -> bool:
        return self.view.is_paged()

    def update(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self._record(layer_idx, k, v)
        return self.view.update(layer_idx, k, v)

    def advance(self, n: int) -> None:
        self.view.advance(n)

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
        self._record(layer_idx, k, v)
        return self.view.attend(
            layer_idx, q, k, v, scale=scale, sliding_window=sliding_window, softcap=softcap
        )

    def _record(self, layer_idx: int, k: Tensor, v: Tensor) -> None:
        """``k``/``v``: ``[num_tokens, kv_heads, head_dim]``."""
        for absmax, x in ((self.k_absmax, k), (self.v_absmax, v)):
            absmax[layer_idx] = torch.maximum(
                absmax[layer_idx], x.abs().amax(dim=(0, 2)).float()
            )


def calibration_token_ids(encode: Callable[[str], list[int]], max_model_len: int | None) -> list[int]:
    """The calibration text's token ids, at most ``CALIBRATION_TOKENS`` and
    ``max_model_len`` (``None``: a config the engine has not resolved yet)."""
    ids = list(encode(CALIBRATION_TEXT))[: min(CALIBRATION_TOKENS, max_model_len or CALIBRATION_TOKENS)]
    if not ids:
        raise ValueError("calculate_kv_scales: the tokenizer encodes the calibration text to no tokens")
    return ids


@torch.inference_mode()
def calibrated_kv_scales(
    config: EngineConfig,
    loaded: LoadedModel,
    num_kv_heads: int | None = None,
    forward: Callable[[Tensor, Any, list[int]], Any] | None = None,
) -> KVScales:
    """``calculate_kv_scales``: one pass of ``loaded``'s model over the
    calibration text through a small cache of its own in the model's dtype
    (freed afterwards), recording each of its layers' K/V absmax per kv head
    (``num_kv_heads``: this rank's; default the model's); returns the scales
    ``[num_layers, kv_heads]`` for ``config.kv_cache_dtype``. ``forward(ids,
    view, rows)`` runs the pass (a pipeline stage's worker passes its
    stage's turn; default ``model.hidden_states``): a stage records only its
    own layers, the rows of the others stay at the smallest scale."""
    model, mc = loaded.model, loaded.config
    kv_heads = num_kv_heads or mc.num_kv_heads
    device = next(model.parameters()).device
    token_ids = calibration_token_ids(loaded.tokenizer.encode, config.max_model_len)
    layers = tuple(model.pp.layers)  # this rank's (a pipeline stage's) layers
    spec = KVCacheSpec((KVCacheGroup(layers, None),), kv_heads, mc.head_dim, loaded.dtype, block_size=16)
    pool = PagedKVPool.from_spec(spec, -(-len(token_ids) // spec.block_size), device, enable_prefix_caching=False)
    seq_id, _ = pool.allocate_sequence(token_ids, skip_prefix_cache=True)
    view = pool.step_view([seq_id], [0], [len(token_ids)])
    recorder = AbsmaxRecorder(view, mc.num_layers, kv_heads, device)
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    if forward is None:
        model.hidden_states(ids, view.meta.positions, recorder)
    else:
        forward(ids, recorder, [])
    pool.free_seq(seq_id)
    cache_dtype = cache_dtype_for(config.kv_cache_dtype, loaded.dtype)
    return KVScales(
        head_scales_from_absmax(recorder.k_absmax, cache_dtype),
        head_scales_from_absmax(recorder.v_absmax, cache_dtype),
        len(token_ids),
    )
