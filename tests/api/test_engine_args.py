"""CLI flags come from EngineConfig's fields, so they cannot drift from it."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from paged_server.config import EngineConfig
from paged_server.entrypoints.cli import build_parser
from paged_server.entrypoints.openai.engine_args import add_engine_flags, engine_config_from_args


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    return p


def test_every_field_has_a_flag_and_defaults_match() -> None:
    args = parser().parse_args([])
    assert engine_config_from_args(args) == EngineConfig()
    flags = {a for action in parser()._actions for a in action.option_strings}
    for f in dataclasses.fields(EngineConfig):
        assert "--" + f.name.replace("_", "-") in flags


def test_flags_parse_into_typed_fields() -> None:
    args = parser().parse_args([
        "--kv-cache-backend", "contiguous", "--block-size", "32", "--num-gpu-blocks", "none",
        "--no-enable-prefix-caching", "--max-queue-len", "3", "--model", "/some/dir",
    ])
    config = engine_config_from_args(args)
    assert config.kv_cache_backend == "contiguous"
    assert config.block_size == 32 and config.num_gpu_blocks is None
    assert config.enable_prefix_caching is False and config.max_queue_len == 3
    assert config.model == "/some/dir"


@pytest.mark.parametrize("argv", [["--kv-cache-backend", "ring"], ["--block-size", "x"]])
def test_bad_values_exit_with_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(argv)
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_bad_kv_cache_dtype_is_one_line_listing_the_accepted_values(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--kv-cache-dtype", "fp4"])
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --kv-cache-dtype: invalid choice: 'fp4'" in last
    assert "'auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2', 'int8', 'int4'" in last
    with pytest.raises(ValueError, match=r"kv_cache_dtype: must be one of .*'int4', got 'fp4'"):
        EngineConfig(kv_cache_dtype="fp4").validate()


def test_kv_cache_dtype_flag_parses() -> None:
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8_e5m2"])
    assert engine_config_from_args(args).kv_cache_dtype == "fp8_e5m2"


def test_calculate_kv_scales_flag_parses_and_needs_an_8_bit_cache() -> None:
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "int8", "--calculate-kv-scales"])
    assert engine_config_from_args(args).calculate_kv_scales is True
    assert engine_config_from_args(build_parser().parse_args(["serve"])).calculate_kv_scales is False
    args = build_parser().parse_args(["serve", "--calculate-kv-scales"])
    with pytest.raises(ValueError, match="applies to kv_cache_dtype fp8, .*int8, not 'auto'"):
        engine_config_from_args(args)


def test_invalid_combination_is_reported_by_validate() -> None:
    args = parser().parse_args(["--max-batch-size", "64", "--max-num-batched-tokens", "8"])
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        engine_config_from_args(args)


def test_serve_defaults_bind_loopback() -> None:
    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1" and args.port == 8000 and args.model is None


def test_scheduling_policy_flag_parses_and_refuses_other_policies(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """vLLM's --scheduling-policy: fcfs (default) or priority."""
    assert engine_config_from_args(build_parser().parse_args(["serve"])).scheduling_policy == "fcfs"
    args = build_parser().parse_args(["serve", "--scheduling-policy", "priority"])
    assert engine_config_from_args(args).scheduling_policy == "priority"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--scheduling-policy", "lifo"])
    assert "invalid choice: 'lifo'" in capsys.readouterr().err
