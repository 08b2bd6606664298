"""The trained evaluation model: a fixed held-out split, a pinned standard
library as the rest of its text, ``training.json`` beside the weights,
built once per cache folder, served as ``--model trained-default``, and the
KV-accuracy table runs on it. (The real recipe trains for minutes on ~3M
tokens; these tests patch it down to a few steps on the help() pages.)"""

from __future__ import annotations

import json
import math
import shutil
import sys

import pytest
import torch

from paged_server.default_model import corpus, ensure_default_model
from paged_server.default_model import trained as trained_module
from paged_server.default_model.corpus import Corpus, split_texts
from paged_server.default_model.tokenizer_builder import training_texts
from paged_server.default_model.train import WARM_START, lr_at
from paged_server.models import load_model

# The help() pages alone: the standard library's ~3M tokens take ~20 s to
# parse and tokenize, which the corpus tests below cover on their own.
TINY_RECIPE = {"steps": 4, "batch_size": 2, "seq_len": 16, "lr": 3e-3, "warmup": 2, "seed": 0,
               "eval_every": 2, "mix": {"topics": 1.0}, "warm_start_steps": 2, "copy_rows": 1}  # fmt: skip


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


def test_stdlib_corpus_is_the_pinned_files_without_the_heldout_pages():
    files = corpus.stdlib_files()
    paths = [rel for rel, _ in files]
    assert paths == sorted(paths) and len(files) > 300
    assert "json/decoder.py" in paths and "asyncio/tasks.py" in paths
    # the help() pages (the held-out text's source) and tests are never trained on
    assert not [p for p in paths if p.startswith(("pydoc_data/", "test/")) or "/tests/" in p]
    if sys.version.split()[0] != corpus.STDLIB_PYTHON:
        pytest.skip(f"the corpus is pinned to Python {corpus.STDLIB_PYTHON}'s standard library")
    assert corpus.stdlib_digest(files) == corpus.STDLIB_SHA256


def test_another_stdlib_is_refused_unless_accepted(monkeypatch):
    monkeypatch.setattr(corpus, "STDLIB_SHA256", "0" * 64)
    monkeypatch.setattr(corpus, "docstrings", lambda source: [])  # (skip parsing 8 MB)
    with pytest.raises(RuntimeError, match="standard library.*--any-stdlib"):
        corpus.stdlib_texts()
    sources, _, digest = corpus.stdlib_texts(strict=False)
    assert len(sources) > 300 and digest != "0" * 64


def test_docstrings_are_module_class_and_function_docs():
    source = '''"""A module that says what it is for, in more than forty characters."""
class A:
    """A class whose docstring is long enough to count as prose here."""
    def f(self):
        """Short."""
    async def g(self):
        """An async method, documented at length like the others are."""
'''
    docs = corpus.docstrings(source)
    assert [d.split()[1] for d in docs] == ["module", "class", "async"]


def test_batches_draw_streams_by_share_and_repeat_with_the_seed():
    streams = {"a": torch.ones(1000, dtype=torch.int32),
               "b": torch.full((1000,), 2, dtype=torch.int32)}  # fmt: skip
    data = Corpus(streams, {"a": 0.25, "b": 0.75}, torch.zeros(10), "")
    batch = data.sample(400, 8, torch.Generator().manual_seed(0))
    assert batch.shape == (400, 9) and batch.dtype == torch.long
    assert 0.68 < float((batch[:, 0] == 2).float().mean()) < 0.82
    again = data.sample(400, 8, torch.Generator().manual_seed(0))
    assert torch.equal(batch, again)


def test_a_smaller_model_by_the_same_recipe_is_cached_under_its_own_name(cache_root):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trained_module, "RECIPE", TINY_RECIPE)
        draft = trained_module.ensure_trained_model(cache_root, layers=1)
    assert draft.name == trained_module.TRAINED_MODEL_NAME + "-1layer"
    assert json.loads((draft / "config.json").read_text())["num_hidden_layers"] == 1
    assert json.loads((draft / "training.json").read_text())["recipe"]["layers"] == 1
    loaded = load_model(draft, torch.float32, "cpu")
    assert len(loaded.model.model.layers) == 1


@pytest.mark.parametrize("layers,suffix", [(None, "-copying"), (2, "-2layer-copying")])
def test_the_copying_models_have_their_depths_warm_start_under_their_own_names(cache_root, layers, suffix):
    recipes = {4: {"warm_start_steps": 3, "copy_rows": 2}, 2: {"warm_start_steps": 2, "copy_rows": 1}}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trained_module, "RECIPE", TINY_RECIPE)
        mp.setattr(trained_module, "COPYING", recipes)
        model = trained_module.ensure_trained_model(cache_root, layers=layers, copying=True)
        with pytest.raises(ValueError, match="no copying recipe for 3 layers"):
            trained_module.ensure_trained_model(cache_root, layers=3, copying=True)
    assert model.name == trained_module.TRAINED_MODEL_NAME + suffix
    recipe = json.loads((model / "training.json").read_text())["recipe"]
    depth = layers or 4
    assert (recipe["layers"], recipe["warm_start_steps"], recipe["copy_rows"]) == (
        depth, recipes[depth]["warm_start_steps"], recipes[depth]["copy_rows"])


def test_lr_warms_up_then_decays_to_a_tenth():
    lrs = [lr_at(s, 100, 1.0, 10) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:], strict=False))
    assert lrs[-1] == pytest.approx(0.1, abs=0.01)


def test_trained_model_is_built_once_with_its_report(tiny_trained, cache_root, monkeypatch):
    report = json.loads((tiny_trained / "training.json").read_text())
    recipe = {k: v for k, v in TINY_RECIPE.items() if k != "eval_every"}
    assert report["recipe"] == {**recipe, "weight_decay": 0.1, "heldout_share": 0.1, "layers": 4,
                                "warm_start": WARM_START}  # fmt: skip
    assert len(report["warm_start_loss_first_last"]) == len(report["copy_loss_first_last"]) == 2
    assert math.isfinite(report["heldout_loss"]) and report["heldout_tokens"] > 10_000
    (step_a, loss_a), (step_b, loss_b) = report["heldout_curve"]
    assert (step_a, step_b) == (2, 4) and loss_b < loss_a  # learning, on text never trained on
    assert report["stream_tokens"]["topics"] == report["train_tokens"] > 80_000

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
    from kv_accuracy import trained_kv_accuracy_table

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
