"""``speculative_config``, as vLLM takes it: which speculation, how far ahead, when to stop.

The operator passes a JSON object (``--speculative-config``) or a dict
(``LLM(speculative_config=...)``) with vLLM's keys; ``SpeculativeConfig.parse``
checks it once, with vLLM's defaults, and says in one line what is wrong.
Built: ``"method": "ngram"`` (prompt lookup: drafts copied from the
request's own prompt and output; vLLM also accepts ``"model": "[ngram]"``)
and a draft model (``"model": DIR``, or ``"method": "draft_model"``: a
smaller model with the target's tokenizer drafts greedily). EAGLE, Medusa,
MTP and MLP speculators are named and refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# vLLM's SpeculativeConfig keys: accepted here (those that change nothing on
# one device or with ngram are accepted and documented as no-ops).
_KEYS = {
    "method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
    "disable_by_batch_size", "disable_logprobs", "disable_log_stats",
    "draft_tensor_parallel_size", "quantization", "max_model_len", "revision",
    "code_revision", "speculative_token_tree", "disable_padded_drafter_batch",
    "min_acceptance",  # ours (engine/speculative/acceptance_gate.py)
}  # fmt: skip
_NOT_BUILT = {"eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "suffix"}
# vLLM's ngram defaults when neither bound is given ("arbitrarily chosen", its comment says).
NGRAM_DEFAULT_LOOKUP = 5
MIN_ACCEPTANCE = 0.3  # the acceptance gate's default floor (engine/speculative/acceptance_gate.py)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding as run: ``method`` ("ngram" or "draft_model"), at most
    ``num_speculative_tokens`` drafts per sequence and step, the n-gram
    lengths the lookup tries (longest first), and the running-sequence count
    from which no sequence speculates (``disable_by_batch_size``; None: never)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    disable_by_batch_size: int | None = None
    # a sequence whose recent drafts were kept less often than this stops
    # drafting (probing again now and then); 0 drafts always, as vLLM does.
    # Above it the measured step cost decides (engine/speculative/step_cost.py):
    # this floor only keeps sequences whose drafts plainly miss from costing
    # a verify step each
    min_acceptance: float = MIN_ACCEPTANCE
    # draft_model: the draft's directory (or cached HF id), and vLLM's draft
    # keys: its quantization and context length (None: the target's)
    model: str | None = None
    quantization: str | None = None
    max_model_len: int | None = None

    @staticmethod
    def parse(spec: dict[str, Any]) -> SpeculativeConfig:
        """Check ``spec`` (vLLM's keys and defaults); ``ValueError`` names what is wrong."""
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config: must be a JSON object, got {spec!r}")
        unknown = sorted(set(spec) - _KEYS)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {', '.join(unknown)}; vLLM's keys are "
                f"{', '.join(sorted(_KEYS))}"
            )
        method, model = spec.get("method"), spec.get("model")
        if method is None and model in ("ngram", "[ngram]"):
            method = "ngram"  # vLLM's older spelling
        if method is None and model is not None:
            method = "draft_model"  # vLLM: a model that is no EAGLE/Medusa/MTP head drafts
        if method in ("ngram", "[ngram]"):
            method = "ngram"
        elif method == "draft_model":
            if not isinstance(model, str) or not model:
                raise ValueError(
                    'speculative_config: "method": "draft_model" needs "model": the draft '
                    f"model's directory, got {model!r}"
                )
        elif method in _NOT_BUILT:
            raise ValueError(
                f"speculative_config: method {method!r} is not built here; "
                '"method": "ngram" (prompt lookup) and "draft_model" ("model": DIR) are'
            )
        elif method is None:
            raise ValueError('speculative_config: needs "method" (e.g. "ngram") or a draft "model"')
        else:
            raise ValueError(
                f'speculative_config: unknown method {method!r}; "ngram" and "draft_model" are built'
            )
        k = spec.get("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(
                f"speculative_config: num_speculative_tokens must be an integer >= 1, got {k!r}"
            )
        low, high = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        if low is None and high is None:
            low = high = NGRAM_DEFAULT_LOOKUP
        low = high if low is None else low
        high = low if high is None else high
        for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {value!r}")
        if low > high:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})"
            )
        off = spec.get("disable_by_batch_size")
        if off is not None and (isinstance(off, bool) or not isinstance(off, int) or off < 2):
            raise ValueError(
                f"speculative_config: disable_by_batch_size must be an integer >= 2, got {off!r}"
            )
        gate = spec.get("min_acceptance", MIN_ACCEPTANCE)
        if isinstance(gate, bool) or not isinstance(gate, (int, float)) or not 0 <= gate <= 1:
            raise ValueError(f"speculative_config: min_acceptance must be a number in [0, 1], got {gate!r}")
        draft_len = spec.get("max_model_len")
        if draft_len is not None and (isinstance(draft_len, bool) or not isinstance(draft_len, int) or draft_len < 2):
            raise ValueError(f"speculative_config: max_model_len must be an integer >= 2, got {draft_len!r}")
        if method == "ngram":
            model = None
        return SpeculativeConfig(
            method, k, low, high, off, float(gate), model, spec.get("quantization"), draft_len
        )

    def speculates(self, num_running: int) -> bool:
        """Whether sequences speculate while ``num_running`` run."""
        return self.disable_by_batch_size is None or num_running < self.disable_by_batch_size
