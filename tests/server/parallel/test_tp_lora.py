"""TP=2 with LoRA adapters gives the tokens of TP=1: each rank loads its
shard of every adapter (B's rows on the column-parallel q/k/v and gate/up,
A's columns on the row-parallel o and down, whose partial delta joins the
all-reduce), by commands riding the steps to the worker process, in a batch
mixing two adapters and the base model; an unload reaches every rank."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from paged_server import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.timeout(300)

BASE: dict[str, Any] = dict(
    device="cpu", dtype="float32", attention_backend="ref", max_model_len=64,
    max_num_batched_tokens=16, block_size=4, max_batch_size=4, enable_lora=True, max_loras=2,
    max_lora_rank=8,
)  # fmt: skip
TARGETS = {"all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "attn": ["q_proj", "v_proj", "o_proj"]}  # fmt: skip


def _adapters(checkpoint: Path, root: Path) -> list[LoRARequest]:
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    out = []
    for i, (name, targets) in enumerate(TARGETS.items(), 1):
        torch.manual_seed(i)
        peft_model = get_peft_model(copy.deepcopy(hf), LoraConfig(r=8 // i, lora_alpha=16,
                                    target_modules=targets, init_lora_weights=False))  # fmt: skip
        peft_model.save_pretrained(root / name)
        out.append(LoRARequest(name, i, str(root / name)))
    return out


def _generate(path: Path, tp: int, loras: list[LoRARequest | None]) -> list[list[int]]:
    prompts = [[7 + i, 8, 9, 10, 11, 12, 13, 14, 15, 16 + i, 17, 18 + 2 * i] for i in range(len(loras))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(str(path), tensor_parallel_size=tp, **BASE) as llm:
        results = llm.generate(prompt_token_ids=prompts, sampling_params=params, lora_request=loras)
        engine = llm.engine
        if any(loras):
            assert engine.remove_lora("attn") and engine.list_loras() == {1}
            llm.generate(prompt_token_ids=prompts[:1], sampling_params=params)  # carries the unload
            assert engine.worker.lora.names == ["all"] and engine.audit() == []
    return [r.outputs[0].token_ids for r in results]


def test_tp2_equals_tp1_with_adapters(tp_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    path = tp_checkpoints["llama"]
    all_, attn = _adapters(path, tmp_path)
    loras = [all_, None, attn, all_, attn]
    one = _generate(path, 1, loras)
    assert _generate(path, 2, loras) == one
    assert _generate(path, 1, [None] * len(loras)) != one  # the adapters change the tokens
