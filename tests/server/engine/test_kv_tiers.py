"""KV cache tiers (``--kv-offloading-size``, ``--kv-disk-dir``): a returning
prompt whose blocks the pool evicted is restored from host memory or disk
instead of recomputed, with the tokens of an engine without tiers; files of
another model, corrupted or left half-written are never served."""

from __future__ import annotations

import pytest
import torch

from paged_core.block_pool import hash_block_tokens
from paged_server.entrypoints.llm import LLM
from paged_server.entrypoints.openai.metrics import ServerMetrics
from paged_server.models import load_model
from paged_server.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
# 48-token prompts in blocks of 4 (11 cacheable blocks each) over a 32-block pool:
# four other prompts in between evict every block of the first.
POOL = dict(max_batch_size=4, max_model_len=128, block_size=4, num_gpu_blocks=32, device="cpu",
            attention_backend="ref", enforce_eager=True)
HOST = 0.001  # GiB: hundreds of the tiny model's blocks


def turns(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    """Each prompt on its own, in order: (tokens, cached prompt tokens)."""
    out = []
    for prompt in prompts:
        (result,) = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, use_tqdm=False)
        out.append((result.outputs[0].token_ids, result.num_cached_tokens))
    return out


@pytest.fixture
def returning(prompt_of) -> list[list[int]]:
    """A prompt, four others that push it out of the pool, then it again."""
    first = prompt_of(48, 1)
    return [first] + [prompt_of(48, 10 + i) for i in range(4)] + [first]


def test_a_returning_prompt_is_served_from_the_host_tier(tiny_loaded, returning) -> None:
    plain = turns(LLM(loaded=tiny_loaded, **POOL), returning)
    llm = LLM(loaded=tiny_loaded, kv_offloading_size=HOST, **POOL)
    tiered = turns(llm, returning)
    assert plain[-1][1] == 0  # the pool alone lost it
    assert tiered[-1][1] == 44  # every full block before the last token's
    assert [t for t, _ in tiered] == [t for t, _ in plain]
    m = llm.engine.metrics()
    assert m["kv_offload_hits_host_tokens_total"] == 44 and m["kv_offload_bytes_restored_total"] > 0
    assert llm.engine.audit() == []
    page = ServerMetrics("m")
    page.read_engine_from(llm.engine.metrics)
    assert 'paged:kv_offload_hits_host_tokens_total{model_name="m"} 44.0' in page.render().decode()


@pytest.mark.parametrize("kv", [dict(kv_cache_dtype="int8"), dict(dtype="bfloat16")], ids=["int8", "bf16"])
def test_tiers_give_the_same_tokens_for_each_cache_dtype(tiny_model_dir, returning, kv) -> None:
    base = dict(POOL, **kv)
    plain = turns(LLM(str(tiny_model_dir), **base), returning)
    llm = LLM(str(tiny_model_dir), kv_offloading_size=HOST, **base)
    tiered = turns(llm, returning)
    assert (plain[-1][1], tiered[-1][1]) == (0, 44)
    assert [t for t, _ in tiered] == [t for t, _ in plain]


def block_files(root) -> list:
    (folder,) = [p for p in root.iterdir() if p.is_dir()]
    return sorted(folder.glob("*.kvblock"))


def key_of(prompt: list[int], i: int, block_size: int = 4) -> str:
    """The file name stem of the prompt's block ``i`` (its chained key)."""
    key = None
    for j in range(i + 1):
        key = hash_block_tokens(key, prompt[j * block_size : (j + 1) * block_size])
    return key.hex()


@pytest.fixture
def written(tiny_loaded, returning, tmp_path):
    """A disk tier written by one engine (shut down), and its plain tokens."""
    llm = LLM(loaded=tiny_loaded, kv_disk_dir=str(tmp_path), **POOL)
    plain = turns(llm, returning[:1])
    llm.shutdown()
    return tmp_path, plain[0][0]


def restart(tiny_loaded, root, prompt):
    llm = LLM(loaded=tiny_loaded, kv_disk_dir=str(root), **POOL)
    ((tokens, cached),) = turns(llm, [prompt])
    return llm, tokens, cached


def test_a_restarted_engine_restores_known_prefixes_from_disk(tiny_loaded, written, returning) -> None:
    root, tokens = written
    assert len(block_files(root)) >= 11
    llm, again, cached = restart(tiny_loaded, root, returning[0])
    assert cached == 44 and again == tokens
    assert llm.engine.metrics()["kv_offload_hits_disk_tokens_total"] == 44


def test_a_corrupted_file_is_recomputed_with_one_warning(tiny_loaded, written, returning, caplog) -> None:
    root, tokens = written
    (folder,) = [p for p in root.iterdir() if p.is_dir()]
    bad = folder / (key_of(returning[0], 5) + ".kvblock")
    data = bytearray(bad.read_bytes())
    data[-10] ^= 0xFF  # one bit pattern in the K/V bytes
    bad.write_bytes(bytes(data))
    (folder / (key_of(returning[0], 8) + ".kvblock")).write_bytes(data[: len(data) // 2])  # truncated too
    llm, again, cached = restart(tiny_loaded, root, returning[0])
    assert cached == 20 and again == tokens  # blocks 0-4; block 5 on are recomputed
    warnings = [r for r in caplog.records if "not restored" in r.getMessage()]
    assert len(warnings) == 1 and "checksum" in warnings[0].getMessage()
    assert bad.read_bytes() != bytes(data)  # replaced by the recomputed block


def test_files_of_another_model_are_never_restored(tiny_model_dir, written, returning) -> None:
    root, _ = written
    other = load_model(tiny_model_dir, torch.float32, "cpu")
    with torch.no_grad():
        for p in other.model.parameters():
            p.mul_(1.5)  # same architecture, shapes and config: other weights
    plain = turns(LLM(loaded=other, **POOL), returning[:1])
    theirs = block_files(root)
    llm, again, cached = restart(other, root, returning[0])
    assert cached == 0 and again == plain[0][0]  # its own folder, empty at start
    llm.shutdown()
    # the first model's files copied over this model's are refused by their header
    (mine,) = [p for p in root.iterdir() if p.is_dir() and p != theirs[0].parent]
    for p in theirs:
        (mine / p.name).write_bytes(p.read_bytes())
    llm, again, cached = restart(other, root, returning[0])
    assert cached == 0 and again == plain[0][0]


def test_an_unwritable_disk_degrades_to_recompute(tiny_loaded, returning, tmp_path, caplog) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")  # root ignores permissions: a file where the folder goes
    plain = turns(LLM(loaded=tiny_loaded, **POOL), returning)
    llm = LLM(loaded=tiny_loaded, kv_disk_dir=str(blocked), **POOL)
    tiered = turns(llm, returning)
    assert [t for t, _ in tiered] == [t for t, _ in plain]
    (warning,) = [r for r in caplog.records if "KV disk tier" in r.getMessage()]
    assert "recomputed" in warning.getMessage()


def test_a_kill_mid_write_leaves_a_tmp_file_that_is_never_read(tiny_loaded, written, returning) -> None:
    root, tokens = written
    (folder,) = [p for p in root.iterdir() if p.is_dir()]
    half = folder / (key_of(returning[0], 3) + ".kvblock")
    tmp = half.with_name(half.name + ".999999999.tmp")  # a dead writer's
    tmp.write_bytes(half.read_bytes()[:100])
    half.unlink()  # the rename never happened
    llm, again, cached = restart(tiny_loaded, root, returning[0])
    assert cached == 12 and again == tokens
    assert not tmp.exists()
