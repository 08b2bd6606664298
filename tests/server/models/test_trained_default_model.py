"""The trained evaluation model: a fixed held-out split, ``training.json``
beside the weights, built once per cache folder, served as ``--model
trained-default``, and the KV-accuracy table runs on it. (The real recipe
trains for minutes; these tests patch it down to a few steps.)"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from paged_server.default_model import ensure_default_model
from paged_server.default_model import trained as trained_module
from paged_server.default_model.tokenizer_builder import training_texts
from paged_server.default_model.train import split_texts

TINY_RECIPE = {"steps": 3, "batch_size": 2, "seq_len": 16, "lr": 3e-3, "seed": 0}


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    """A cache folder holding a copy of the default model (not built again)."""
    root = tmp_path_factory.mktemp("cache")
    source = ensure_default_model()
    shutil.copytree(source, root / source.name)
    return root


@pytest.fixture(scope="module")
def tiny_trained(cache_root):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trained_module, "RECIPE", TINY_RECIPE)
        return trained_module.ensure_trained_model(cache_root)


def test_heldout_text_is_the_tail_of_every_page_and_never_trained_on():
    train, heldout = split_texts()
    pages = training_texts()
    share = sum(map(len, heldout)) / sum(map(len, pages))
    assert 0.05 < share < 0.15
    assert len(heldout) > 50
    train_paragraphs = {p.strip() for page in train for p in page.split("\n\n")}
    heldout_paragraphs = {p.strip() for page in heldout for p in page.split("\n\n")}
    assert not (train_paragraphs & heldout_paragraphs) - {""}  # pages repeat paragraphs: none leaks


def test_trained_model_is_built_once_with_its_report(tiny_trained, cache_root, monkeypatch):
    report = json.loads((tiny_trained / "training.json").read_text())
    assert report["recipe"] == {**TINY_RECIPE, "heldout_share": 0.1}
    assert math.isfinite(report["heldout_loss"]) and report["heldout_tokens"] > 10_000
    assert report["last_train_loss"] < report["first_train_loss"]

    def fail(*args, **kw):
        raise AssertionError("trained again")

    monkeypatch.setattr("paged_server.default_model.train.train", fail)
    assert trained_module.ensure_trained_model(cache_root) == tiny_trained  # cached


def test_engine_serves_trained_default(tiny_trained, cache_root, monkeypatch, prompt_of):
    from paged_server.entrypoints.llm import LLM
    from paged_server.sampling_params import SamplingParams

    monkeypatch.setenv("PAGED_CACHE_DIR", str(cache_root))
    llm = LLM(model="trained-default", max_model_len=64, max_batch_size=2, device="cpu",
              attention_backend="ref", kv_cache_dtype="int4")  # fmt: skip
    (out,) = llm.generate(prompt_token_ids=[prompt_of(8, 1)],
                          sampling_params=SamplingParams(max_tokens=4, temperature=0.0),
                          use_tqdm=False)  # fmt: skip
    assert len(out.outputs[0].token_ids) >= 1


def test_trained_accuracy_table_has_int4_rows_per_block_size(tiny_trained):
    from paged_server.bench.kv_accuracy import trained_kv_accuracy_table
    from paged_server.models import load_model

    loaded = load_model(tiny_trained, torch.float32, "cpu")
    table = trained_kv_accuracy_table(loaded, "tiny", num_prompts=2, prompt_len=8, max_tokens=4,
                                      text_tokens=200, window=64, int4_block_sizes=(16, 64),
                                      kv_cache_dtypes=("int8", "int4"))  # fmt: skip
    rows = {(r["kv_cache_dtype"], r["calculate_kv_scales"], r["block_size"]): r for r in table["rows"]}
    assert set(rows) == {("auto", False, 16), ("int8", False, 16), ("int8", True, 16),
                         ("int4", False, 16), ("int4", False, 64)}  # fmt: skip
    auto = rows[("auto", False, 16)]
    assert auto["ppl_vs_auto"] == 1.0 and auto["greedy_agreement"] == 1.0
    for r in rows.values():
        assert math.isfinite(r["perplexity"]) and 0 <= r["greedy_agreement"] <= 1
    assert rows[("int4", False, 64)]["perplexity"] != auto["perplexity"]  # really quantized
