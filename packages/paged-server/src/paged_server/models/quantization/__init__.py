"""Quantized weights as vLLM loads them: compressed-tensors, GPTQ and AWQ
checkpoints, and online fp8/int8/int4 (``--quantization``).

One file per format turns its tensors into a ``QuantizedWeight``
(weights.py); ``QuantizedLinear`` (linear.py) runs it; load.py swaps those
into a model's linear layers by name; methods.py decides which format;
summary.py states the result on the start-up line.
"""

from __future__ import annotations

from paged_server.models.quantization.linear import QuantizedLinear
from paged_server.models.quantization.load import load_quantized_layers, quantize_layers
from paged_server.models.quantization.methods import (
    QUANTIZATION_METHODS,
    Quantization,
    resolve_quantization,
)
from paged_server.models.quantization.summary import linear_formats, weight_bytes, weights_summary
from paged_server.models.quantization.weights import QuantizedWeight

__all__ = [
    "QUANTIZATION_METHODS",
    "QuantizedLinear",
    "QuantizedWeight",
    "Quantization",
    "linear_formats",
    "load_quantized_layers",
    "quantize_layers",
    "resolve_quantization",
    "weight_bytes",
    "weights_summary",
]
