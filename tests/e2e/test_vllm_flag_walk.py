"""Every flag of `vllm serve --help` (vllm_serve_flags.txt, read from vLLM's
source) either parses here or is refused with a one-line hint saying what
to do instead: a vLLM launch line never meets argparse's bare
"unrecognized arguments"."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from paged_server.entrypoints.cli import build_parser, main

pytestmark = pytest.mark.e2e

FLAGS = [line.strip() for line in (Path(__file__).parent / "vllm_serve_flags.txt").read_text().splitlines()
         if line.strip() and not line.startswith("#")]


def _serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


# Values of known flags that "1" is not one of.
SAMPLES = {"--load-format": "auto", "--served-model-name": "m", "--lora-modules": "sql=/adapters/sql"}


def _sample_argv(action: argparse.Action, flag: str) -> list[str]:
    """The flag with a value its action takes."""
    if flag in SAMPLES:
        return [flag, SAMPLES[flag]]
    if action.nargs == 0:
        return [flag]
    if action.choices:
        return [flag, str(next(iter(action.choices)))]
    if action.dest.startswith("allowed_"):
        return [flag, '["*"]']
    if action.metavar == "JSON":
        return [flag, "{}"]
    return [flag, "1"]


def test_the_list_is_vllms() -> None:
    # a few from each group, and the flags issue 58 names
    for flag in ("--model", "--tensor-parallel-size", "--enable-sleep-mode", "--kv-offloading-size",
                 "--return-tokens-as-token-ids", "--enable-server-load-tracking", "-O", "-asc"):
        assert flag in FLAGS
    assert len(FLAGS) == len(set(FLAGS)) > 200


@pytest.mark.parametrize("flag", FLAGS)
def test_each_vllm_flag_parses_or_has_a_hint(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    action = _serve_parser()._option_string_actions.get(flag)
    if action is not None and type(action).__name__ != "_Refuse":
        args = build_parser().parse_args(["serve", *_sample_argv(action, flag)])
        assert hasattr(args, action.dest)
        return
    with pytest.raises(SystemExit) as exc:
        main(["serve", flag, "1"])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    hint = [line.strip() for line in lines if line.strip().startswith(f"{flag}: ")
            or f"error: {flag}: " in line]
    assert hint, f"{flag}: argparse's bare error, no hint:\n" + "\n".join(lines)
    text = hint[0].split(f"{flag}: ", 1)[1]
    assert len(text) > 10 and "did you mean" not in text, hint[0]
