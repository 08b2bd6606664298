"""``calculate_kv_scales``: static K/V scales per (layer, kv head) from one
calibration pass at start-up. The calibration is deterministic and per head;
int8 then holds exactly 4x the tokens of a float32 cache; bad combinations
are one-line errors. That an engine with calculated scales is still a cache
(paged = contiguous, prefix caching, chunked prefill, forced preemption and
n > 1 forks change nothing) is tested beside per-token int8, in
test_kv_cache_dtype.py."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from paged_server.config import EngineConfig
from paged_server.engine.kv.kv_calibration import calibrated_kv_scales
from paged_server.entrypoints.openai.app import ServerSettings
from paged_server.entrypoints.openai.server import startup_line

STATIC = dict(calculate_kv_scales=True)


def test_calibration_is_deterministic_and_per_head(tiny_loaded) -> None:
    config = EngineConfig(kv_cache_dtype="int8", calculate_kv_scales=True, max_model_len=128)
    first, again = calibrated_kv_scales(config, tiny_loaded), calibrated_kv_scales(config, tiny_loaded)
    layers, kv_heads = tiny_loaded.config.num_layers, tiny_loaded.config.num_kv_heads
    assert first.k.shape == first.v.shape == (layers, kv_heads)
    assert first.k.dtype == torch.float32 and (first.k > 0).all() and (first.v > 0).all()
    assert torch.equal(first.k, again.k) and torch.equal(first.v, again.v)
    assert first.num_tokens == 128  # the calibration text, cut to max_model_len
    # K of the last layer's kv head 1 made 4x larger: only that head's K scale grows, 4x.
    model = copy.deepcopy(tiny_loaded.model)
    last = model.model.layers[-1].self_attn
    head_dim = tiny_loaded.config.head_dim
    k_rows = tiny_loaded.config.num_heads * head_dim  # q_proj's rows come first in qkv_proj
    with torch.no_grad():
        last.qkv_proj.weight[k_rows + head_dim : k_rows + 2 * head_dim] *= 4
    scaled = calibrated_kv_scales(config, dataclasses.replace(tiny_loaded, model=model))
    torch.testing.assert_close(scaled.k[-1, 1], 4 * first.k[-1, 1], rtol=1e-5, atol=0)
    assert torch.equal(scaled.k[-1, 0], first.k[-1, 0])
    assert torch.equal(scaled.k[:-1], first.k[:-1]) and torch.equal(scaled.v, first.v)
    fp8 = calibrated_kv_scales(dataclasses.replace(config, kv_cache_dtype="fp8"), tiny_loaded)
    torch.testing.assert_close(fp8.k * 448, first.k * 127)  # same absmax, e4m3's qmax


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_static_int8_holds_exactly_four_times_a_float32_cache(make_engine, backend) -> None:
    """The tiny model is float32: one byte per value instead of four, with no
    per-token scale bytes (a 16-bit model's pool would hold exactly 2x)."""
    budget = 1 << 20
    tokens = {}
    for name, kw in {
        "auto": {},
        "int8": dict(kv_cache_dtype="int8"),
        "int8+calc": dict(kv_cache_dtype="int8", **STATIC),
        "fp8+calc": dict(kv_cache_dtype="fp8", **STATIC),
    }.items():
        engine = make_engine(kv_cache_backend=backend, kv_cache_memory_bytes=budget,
                             max_batch_size=256, max_model_len=64, max_num_batched_tokens=256,
                             **kw)  # fmt: skip
        tokens[name] = engine.capacity.tokens
        assert engine.capacity.kv_bytes <= budget
    assert tokens["int8+calc"] == tokens["fp8+calc"] == 4 * tokens["auto"]
    assert tokens["int8"] < tokens["int8+calc"]


def test_startup_line_says_scales_are_calculated(make_engine) -> None:
    engine = make_engine(kv_cache_dtype="int8", num_gpu_blocks=10, **STATIC)
    line = startup_line(engine, ServerSettings(model_name="tiny"), "http://127.0.0.1:1")
    assert "KV cache int8 (kv_cache_dtype=int8, calculated scales): capacity 40 tokens" in line


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(calculate_kv_scales=True),
         "calculate_kv_scales: applies to kv_cache_dtype fp8, fp8_e4m3, fp8_e5m2, int8, not 'auto'"),
        (dict(calculate_kv_scales="yes", kv_cache_dtype="int8"), "must be True or False"),
    ],
)  # fmt: skip
def test_bad_combinations_are_one_line_errors(overrides, message) -> None:
    with pytest.raises(ValueError, match=message) as err:
        EngineConfig(**overrides).validate()
    assert "\n" not in str(err.value)
