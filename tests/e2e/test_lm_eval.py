"""lm-evaluation-harness (``local-completions``) against the real server on
two tiny local tasks: loglikelihood (multiple choice, through ``echo`` +
``logprobs``) and generate_until. The loglikelihoods it records equal
transformers' on the same checkpoint. Nothing is downloaded: the tasks and
their data are in ``lm_eval_task/``, the tokenizer is the served model's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paged_server.default_model import ensure_default_model

lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

TASK_DIR = Path(__file__).parent / "lm_eval_task"

pytestmark = pytest.mark.slow


@pytest.fixture
def task_dir(tmp_path: Path) -> Path:
    yaml = (TASK_DIR / "paged_tiny.yaml").read_text()
    (tmp_path / "paged_tiny.yaml").write_text(
        yaml.replace("DATA_FILE", str(TASK_DIR / "tiny.jsonl"))
    )
    return tmp_path


def hf_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """As lm_eval splits a pair: encode the whole, the context alone, the rest
    is the continuation."""
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    n_ctx = len(tokenizer(context, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
    return sum(logprobs[p - 1, whole[p]].item() for p in range(n_ctx, len(whole)))


def test_lm_eval_local_completions(server, task_dir, monkeypatch) -> None:
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model_dir = str(ensure_default_model())
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "base_url": f"{server.url}/v1/completions",
            "model": "tiny",
            "tokenizer": model_dir,
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,
            "num_concurrent": 1,
            "max_retries": 1,
        },
        tasks=["paged_tiny"],
        task_manager=TaskManager(include_path=str(task_dir)),
        log_samples=True,
        bootstrap_iters=0,
    )
    assert results is not None

    def task(section: str, name: str):  # keys may carry the group ("paged_tiny::...")
        (key,) = [k for k in results[section] if k.split("::")[-1] == name]
        return results[section][key]

    assert "exact_match,none" in task("results", "paged_tiny_generate")
    assert "acc,none" in task("results", "paged_tiny_choice")
    generated = task("samples", "paged_tiny_generate")
    assert len(generated) == 4 and all(isinstance(s["resps"][0][0], str) for s in generated)

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    scored = 0
    for sample in task("samples", "paged_tiny_choice"):
        # arguments: one (context, continuation) per choice; resps: [(loglikelihood, greedy)]
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"], strict=True):
            got, _is_greedy = resp[0]
            want = hf_loglikelihood(model.eval(), tokenizer, context, continuation)
            assert float(got) == pytest.approx(want, abs=1e-3), (context, continuation)
            scored += 1
    assert scored == 10  # every choice of every question
