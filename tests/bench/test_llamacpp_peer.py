"""The llama.cpp comparison's pieces that need no llama.cpp build: both peers
get the same requests, the medians and ratios are right, a missing build
skips with a message, the page renders the JSON's numbers."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from peers import llamacpp as lc
from peers import serving as ps

PEERS = [ps.PAGED, ps.llamacpp_peer("f32"), ps.llamacpp_peer("f16")]


def test_every_peer_gets_the_same_requests_in_a_rotating_order() -> None:
    runs = ps.schedule(PEERS, [1, 8, 32], repeats=3, num_requests=64, single_stream_requests=8)
    per_slot = Counter((r, c) for r, c, _, _ in runs)
    assert set(per_slot.values()) == {3}  # each peer once per repeat and concurrency
    for concurrency in (1, 8, 32):
        counts = {n for _, c, _, n in runs if c == concurrency}
        assert len(counts) == 1  # same request count for every peer
    assert {n for _, c, _, n in runs if c == 1} == {8}
    firsts = [[p for r, c, p, _ in runs if (r, c) == slot][0] for slot in per_slot]
    assert len(set(firsts)) == 3  # no peer always runs first


def test_request_set_is_token_ids_128_new_tokens_and_smaller_sets_are_prefixes() -> None:
    pool = list(range(3, 4096))
    small, large = ps.peer_workload(pool, 8), ps.peer_workload(pool, 64)
    assert small.requests == large.requests[:8]
    bodies = ps.request_bodies(large)
    assert all(100 <= len(b["prompt"]) <= 400 and all(isinstance(t, int) for t in b["prompt"]) for b in bodies)
    assert {(b["max_tokens"], b["ignore_eos"], b["stream"], b["temperature"]) for b in bodies} == {
        (128, True, True, 0.0)
    }
    assert not any("model" in b for b in bodies)  # nothing a peer would answer differently


def _head(tps: float | None, ttft: float = 10.0, cores: float = 1.0) -> dict[str, float | None]:
    return {"output_tokens_per_s": tps, "ttft_p50_ms": ttft, "itl_p50_ms": 5.0, "itl_p99_ms": 9.0,
            "busy_cores": cores, "other_cores": 0.0}  # fmt: skip


def test_medians_over_repeats_skip_missing_values() -> None:
    m = ps.medians([_head(100.0, 30.0), _head(300.0, 10.0), _head(None, 20.0)])
    assert m["output_tokens_per_s"] == 200.0  # median of the two present
    assert m["ttft_p50_ms"] == 20.0


def test_ratios_against_each_llamacpp_peer_and_the_best() -> None:
    r = ps.ratios({ps.PAGED: _head(120.0), PEERS[1]: _head(100.0), PEERS[2]: _head(150.0)})
    assert r == {"paged / llama.cpp f32": 1.2, "paged / llama.cpp f16": 0.8, "paged / best llama.cpp": 0.8}


def test_missing_build_is_found_missing_and_says_how_to_build(tmp_path: Path) -> None:
    assert lc.find_llamacpp(tmp_path) is None
    msg = lc.missing_message(tmp_path)
    assert str(tmp_path) in msg and "llamacpp_peer.py --build" in msg


def test_benchmark_skips_with_the_message_when_not_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path))
    import llamacpp_peer
    assert llamacpp_peer.main(["--out", str(tmp_path / "results")]) == 0
    assert "llama.cpp peer skipped" in capsys.readouterr().err
    assert not (tmp_path / "results").exists()
    with pytest.raises(FileNotFoundError, match="no built llama-server"):
        ps.compare(tmp_path)


def _fake_server(root: Path, build_dir: str) -> Path:
    server = root / "0.3.9" / "llama_cpp_python-0.3.9" / "vendor" / "llama.cpp" / build_dir / "bin" / "llama-server"
    server.parent.mkdir(parents=True)
    server.write_text("#!/bin/sh\n")
    server.chmod(0o755)
    return server


def test_built_tree_is_found(tmp_path: Path) -> None:
    server = _fake_server(tmp_path, lc.BUILD_DIR)
    tree = lc.find_llamacpp(tmp_path)
    assert tree is not None and tree.version == "0.3.9" and tree.server == server


def test_a_tree_built_with_amx_is_not_used(tmp_path: Path) -> None:
    """build/ (the folder before AMX was compiled out) dies on Q8_0/Q4_0 on an AMX CPU."""
    _fake_server(tmp_path, "build")
    assert lc.find_llamacpp(tmp_path) is None


SAPPHIRE_RAPIDS = frozenset({"fma", "f16c", "avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile",
                             "amx_int8"})  # fmt: skip
EPYC = frozenset({"fma", "f16c", "avx2", "bmi2"})


def test_amx_is_compiled_out_only_where_native_would_turn_it_on() -> None:
    amx = lc.cmake_flags(SAPPHIRE_RAPIDS)
    assert amx[: len(lc.BASE_CMAKE_FLAGS)] == lc.BASE_CMAKE_FLAGS and "-DGGML_NATIVE=ON" in amx
    extra = amx[len(lc.BASE_CMAKE_FLAGS) :]
    # C and C++ both: ggml-cpu has sources of each; every AMX extension off, nothing else touched
    assert {f.split("=", 1)[0] for f in extra} == {"-DCMAKE_C_FLAGS", "-DCMAKE_CXX_FLAGS"}
    for flag in extra:
        assert set(flag.split("=", 1)[1].split()) == {"-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"}
    assert lc.cmake_flags(EPYC) == lc.BASE_CMAKE_FLAGS  # no AMX: the flags of every earlier build
    assert lc.cmake_flags(frozenset()) == lc.BASE_CMAKE_FLAGS  # no /proc/cpuinfo (not Linux)


def test_no_amx_flags_leave_the_other_native_extensions_on() -> None:
    """GCC takes an explicit -mno-* over -march=native in either order: the
    build keeps AVX512/VNNI/BF16 and loses only AMX (checked with the compiler
    that builds llama.cpp, where there is one)."""
    import shutil
    import subprocess

    gcc = shutil.which("gcc")
    if gcc is None or "amx_tile" not in lc.cpu_flags():
        pytest.skip("needs gcc on a CPU with AMX")
    cmd = [gcc, *lc.NO_AMX_CFLAGS.split(), "-march=native", "-dM", "-E", "-"]
    macros = subprocess.run(cmd, input="", capture_output=True, text=True, check=True).stdout
    assert "__AMX_INT8__" not in macros and "__AMX_TILE__" not in macros
    assert "__AVX512VNNI__" in macros and "__AVX512F__" in macros


def test_quantized_pairs_parse_and_bad_ones_are_refused() -> None:
    assert ps.parse_pairs("int8=q8_0, int4=q4_0") == [("int8", "q8_0"), ("int4", "q4_0")] == list(ps.QUANTIZED_PAIRS)
    for bad in ("int8", "int8=q3_x", "=q8_0"):
        with pytest.raises(ValueError, match="METHOD=GGUF_TYPE"):
            ps.parse_pairs(bad)


def test_quantized_flag_switches_the_defaults_to_the_100m_model_at_1_and_8_streams() -> None:
    import llamacpp_peer
    dense, quant = llamacpp_peer.parse_args([]), llamacpp_peer.parse_args(["--quantized"])
    assert (dense.model_config, dense.concurrency, dense.quantized) == ("30m", "1,8,16,32", None)
    assert (quant.model_config, quant.concurrency, quant.quantized) == ("100m", "1,8", "int8=q8_0,int4=q4_0")
    mine = llamacpp_peer.parse_args(["--quantized", "int4=q4_k_m", "--model-config", "30m", "--concurrency", "4"])
    assert (mine.model_config, mine.concurrency, mine.quantized) == ("30m", "4", "int4=q4_k_m")


def test_pair_ratios_compare_each_paged_peer_with_its_own_gguf() -> None:
    pairs = [("paged int8", "llama.cpp q8_0"), ("paged int4", "llama.cpp q4_0")]
    by_peer = {"paged int8": _head(120.0), "llama.cpp q8_0": _head(100.0), "paged int4": _head(90.0),
               "llama.cpp q4_0": _head(150.0)}  # fmt: skip
    assert ps.pair_ratios(by_peer, pairs) == {"paged int8 / llama.cpp q8_0": 1.2, "paged int4 / llama.cpp q4_0": 0.6}
    by_peer["llama.cpp q4_0"] = _head(None)
    assert ps.pair_ratios(by_peer, pairs)["paged int4 / llama.cpp q4_0"] is None


def test_outtype_is_checked_before_any_work(tmp_path: Path) -> None:
    tree = lc.LlamaCpp("0", tmp_path)
    with pytest.raises(ValueError, match="q4_0"):
        lc.convert_to_gguf(tree, tmp_path, "q3_x", root=tmp_path)


def test_embedded_tokenizer_is_named_gpt2_for_the_converter(tmp_path: Path) -> None:
    from paged_server.default_model import ensure_default_model

    assert lc.pre_tokenizer_name(ensure_default_model()) == "gpt-2"
    (tmp_path / "tokenizer.json").write_text(json.dumps({"pre_tokenizer": {"type": "Metaspace"}}))
    assert lc.pre_tokenizer_name(tmp_path) is None


def _fake_results() -> dict:
    med = {
        ps.PAGED: _head(250.0, 40.0, 1.9),
        "llama.cpp f32": _head(200.0, 90.0, 1.95),
    }
    return {
        "environment": {"date": "2026-01-01 00:00 UTC", "hardware": "CPU: test (2 cores)"},
        "model": {"name": "m", "parameters": 32_000_000, "num_hidden_layers": 10, "hidden_size": 512,
                  "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 4096},
        "llamacpp": {"version": "0.3.9", "flags": ["-DGGML_NATIVE=ON"], "server_args": "--parallel N",
                     "gguf_bytes": {"f32": 128_000_000}},
        "workload": {"prompt_tokens": {"min": 100, "max": 400}, "max_tokens": {"max": 128}},
        "plan": {"num_requests": 64, "single_stream_requests": 8, "repeats": 2},
        "agreement": {"f32": {"agree": 5, "of": 5}},
        "table": [{"concurrency": 8, "medians": med, "ratios": ps.ratios(med)}],
        "command": "python benchmarks/llamacpp_peer.py --concurrency 8",
    }  # fmt: skip


def test_page_section_shows_the_json_numbers(tmp_path: Path) -> None:
    import report

    section = "\n".join(report._llamacpp_section(_fake_results()))
    assert "Not run yet" in "\n".join(report._llamacpp_section(None))
    assert "| 8 | paged | 250.0 | 40.0 | 5.0 / 9.0 | 1.90 |" in section
    assert "| 8 | llama.cpp f32 | 200.0 | 90.0 | 5.0 / 9.0 | 1.95 | 0.00 | 1.25x |" in section
    assert "8: 1.25x" in section and "f32 5/5" in section


def test_quantized_page_section_compares_each_pair(tmp_path: Path) -> None:
    data = _fake_results()
    med = {"paged int8": _head(120.0), "llama.cpp q8_0": _head(100.0), "paged int4": _head(90.0),
           "llama.cpp q4_0": _head(150.0)}  # fmt: skip
    pairs = [("paged int8", "llama.cpp q8_0"), ("paged int4", "llama.cpp q4_0")]
    med = dict(sorted(med.items()))  # as json.dump(sort_keys=True) leaves it
    data.update(pairs=[list(p) for p in pairs], table=[{"concurrency": 1, "medians": med, "ratios": ps.pair_ratios(med, pairs)}],
                agreement={"q8_0": {"agree": 1, "of": 5, "paged_peer": "paged int8"},
                           "q4_0": {"agree": 0, "of": 5, "paged_peer": "paged int4"}})  # fmt: skip
    import report

    section = "\n".join(report._llamacpp_section(data, quantized=True))
    assert "llamacpp_peer.py --quantized" in "\n".join(report._llamacpp_section(None, quantized=True))
    assert "| 1 | llama.cpp q8_0 | 100.0 |" in section and section.count("| 1.20x |") == 1  # int8 / Q8_0
    assert "| 1 | llama.cpp q4_0 | 150.0 |" in section and "| 0.60x |" in section  # int4 / Q4_0, not int8's
    assert "| 1 | paged int8 | 120.0 |" in section and "paged int8 vs q8_0 1/5" in section
    assert "paged int4 / llama.cpp q4_0: 1 streams 0.60x" in section
    lines = [ln for ln in section.splitlines() if ln.startswith("| 1 |")]
    assert [ln.split(" | ")[1] for ln in lines] == ["paged int8", "llama.cpp q8_0", "paged int4", "llama.cpp q4_0"]


@pytest.mark.slow
def test_converter_names_the_pre_tokenizer(tiny_model_dir: Path, tmp_path: Path) -> None:
    """With llama.cpp's source present (the build step extracts it): the tiny
    model converts, and the GGUF says ``gpt-2``."""
    sources = sorted(lc.llamacpp_root().glob("*/llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if not sources:
        pytest.skip(lc.missing_message())
    tree = lc.LlamaCpp("src", sources[-1].parent)
    path = lc.convert_to_gguf(tree, tiny_model_dir, "f32", root=tmp_path)
    sys.path.insert(0, str(tree.source / "gguf-py"))
    try:
        from gguf import GGUFReader
    finally:
        sys.path.remove(str(tree.source / "gguf-py"))
    field = GGUFReader(path).fields["tokenizer.ggml.pre"]
    assert bytes(field.parts[field.data[0]]).decode() == "gpt-2"


def test_busy_cores_count_the_whole_process_tree() -> None:
    """A grandchild's CPU seconds count toward the process started (a server
    that forks workers is charged for them)."""
    import subprocess

    burn = "import sys, time\nwhile time.process_time() < 0.3: pass\nprint('done', flush=True)\nsys.stdin.read()"
    proc = subprocess.Popen(["sh", "-c", f'"{sys.executable}" -c "{burn}"'], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "done"
        assert ps.process_tree_cpu_s(proc.pid) >= 0.25  # clock ticks round user and system time apart
    finally:
        proc.communicate(timeout=60)  # closing stdin ends the grandchild, then sh
