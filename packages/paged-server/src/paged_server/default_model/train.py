"""Train the default model's architecture on Python's own text, so that
demos print English-looking words and KV-cache accuracy is measured on a
model that has learnt something.

    python -m paged_server.default_model.train OUT_DIR [--steps N] [--eval-every N]

Writes a complete Hugging Face directory (the default model's files with
trained weights, and ``training.json``: the recipe, the losses, the
held-out loss curve and the corpus's hash) to OUT_DIR; serve it with
``paged-server --model OUT_DIR``. ``paged_server.default_model.trained``
trains the evaluation model (``--model trained-default``) with the fixed
recipe and caches it. Uses our own model code (plain PyTorch, causal
attention without a cache), a fixed seed and CPU by default.

The text (``corpus.py``): the help() pages minus their held-out tails, the
standard library's sources and its docstrings, drawn in fixed shares.
Held-out loss: the mean next-token cross-entropy, in float32, over the
held-out tails' non-overlapping ``seq_len`` windows; text never trained on.
(The tokenizer was trained on all pages, which leaks word pieces, not text.)
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from paged_server.default_model import ensure_default_model
from paged_server.default_model.copy_windows import random_copy_windows, text_copy_windows
from paged_server.default_model.corpus import HELDOUT_SHARE, build_corpus
from paged_server.default_model.tokenizer_builder import SPECIAL_TOKENS
from paged_server.models import load_model
from paged_server.models.loader import checkpoint_state_dict

# The trained evaluation model's recipe (``default_model.trained``), and this CLI's defaults.
RECIPE = {"steps": 2400, "batch_size": 16, "seq_len": 128, "lr": 3e-3, "warmup": 100, "seed": 0,
          "eval_every": 400}  # fmt: skip
# The same recipe for models that copy, by decoder layers: first that many
# ``warm_start`` steps, then RECIPE with ``copy_rows`` windows of repeated text
# beside each batch. Speculative decoding's benchmark pair: the whole model
# (4 layers) as the target, 2 layers as its draft. The copying head forms at
# ~450 warm-start steps on 2 layers and between 1,000 and 1,500 on 4 (5.66
# nats on the repeats at 500, 3.54 at 1,000, 0.18 at 1,500); 550 steps left 4
# layers without it (5.47), and then held-out loss ended at 4.73.
COPYING = {4: {"warm_start_steps": 2500, "copy_rows": 4}, 2: {"warm_start_steps": 550, "copy_rows": 4}}
# The induction warm start (``warm_start``): random-token copy windows of 64
# tokens, 64 a step, lr 1e-3 after 50 warm-up steps, no weight decay. From
# random weights the copying head forms at ~450 steps (2 layers: loss on the
# repeats 8.3 -> 0.5 nats by 550).
WARM_START = {"seq_len": 64, "batch_size": 64, "lr": 1e-3, "warmup": 50}

# Shares of a batch's windows: the help() pages are the held-out text's own
# kind (drawn ~8 times over in the full recipe), the docstrings its nearest
# prose, the sources the bulk (drawn about once).
DEFAULT_MIX = {"topics": 0.15, "docstrings": 0.35, "stdlib": 0.5}


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, ids: torch.Tensor, seq_len: int = 128,
                 batch_tokens: int = 2048) -> float:  # fmt: skip
    """Mean next-token cross-entropy (nats) over ``ids``' non-overlapping
    windows, ``batch_tokens`` tokens a forward pass, in the model's dtype."""
    batch_size = max(1, batch_tokens // seq_len)
    was_training = model.training
    model.eval()
    n = (len(ids) - 1) // seq_len
    windows = torch.stack([ids[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)]).long()
    positions = torch.arange(seq_len, device=ids.device)
    total = 0.0
    for start in range(0, n, batch_size):
        batch = windows[start : start + batch_size]
        logits = model(batch[:, :-1], positions.expand(batch.shape[0], -1))
        total += float(torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum"))  # fmt: skip
    model.train(was_training)
    return total / (n * seq_len)


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then a cosine down to lr/10."""
    if step < warmup:
        return lr * (step + 1) / warmup
    done = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(done, 1.0))))


def autocast_dtype(device: str, precision: str) -> torch.dtype | None:
    """The matmul dtype of the training step: ``auto`` is bfloat16 on CUDA and
    on CPUs with bf16 matrix units (AMX / AVX512-BF16: ~2x the float32 step
    here), else float32 (``None``: no autocast)."""
    from paged_server.platform import cpu_has_bf16

    if precision == "float32":
        return None
    if precision == "bfloat16" or device.startswith("cuda") or cpu_has_bf16():
        return torch.bfloat16
    return None


def train(
    out_dir: Path,
    steps: int = 200,
    batch_size: int = 16,
    seq_len: int = 128,
    lr: float = 3e-3,
    seed: int = 0,
    device: str = "cpu",
    eval_every: int = 0,
    log: bool = False,
    source: Path | None = None,
    *,
    warmup: int = 100,
    weight_decay: float = 0.1,
    mix: dict[str, float] | None = None,
    precision: str = "auto",
    strict_corpus: bool = True,
    layers: int | None = None,
    warm_start_steps: int = 0,
    copy_rows: int = 0,
) -> list[float]:
    """Train from the random default weights; returns the loss of every
    step and writes ``training.json`` (recipe, losses, held-out curve,
    seconds) beside the weights. AdamW (betas 0.9/0.95, ``weight_decay`` on
    matrices only), ``lr_at``'s schedule, gradients clipped at 1.
    ``eval_every``: also score the held-out text every that many steps (0:
    only at the end); ``log``: print progress (step, loss, held-out loss,
    elapsed, ETA) ~20 times and at every held-out score; ``source``: the random
    default model's directory (default: the cached one); ``mix``: the corpus
    streams' shares (``DEFAULT_MIX``); ``precision``: ``auto``, ``bfloat16``
    or ``float32`` matmuls (``autocast_dtype``); ``strict_corpus``: refuse a
    standard library other than the pinned one; ``layers``: keep only the first
    that many decoder layers (a smaller model by the same recipe: a draft
    for speculative decoding); ``warm_start_steps``: first that many steps
    of ``warm_start`` (random tokens repeated: the copying head);
    ``copy_rows``: that many windows of repeated real text beside each
    batch (``text_copy_windows``), their loss (on the repeats) added to the
    text's. The returned losses are the text's alone."""
    mix = dict(DEFAULT_MIX if mix is None else mix)
    source = source or ensure_default_model()
    out_dir.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        shutil.copy(file, out_dir / file.name)
    if layers is not None:
        truncate_layers(out_dir, layers)
    loaded = load_model(out_dir, torch.float32, device)
    model = loaded.model.train().requires_grad_(True)
    corpus = build_corpus(out_dir, mix, strict_corpus)
    heldout = corpus.heldout.to(device)
    cast = autocast_dtype(device, precision)
    torch.manual_seed(seed)  # (nothing random happens outside ``gen`` today; kept fixed anyway)
    gen = torch.Generator().manual_seed(seed)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), fused=device == "cpu" or None,
    )  # fmt: skip
    start, cpu_start = time.perf_counter(), time.process_time()
    warm_losses = warm_start(model, warm_start_steps, loaded.config.vocab_size, gen, device, cast, log)
    copy_losses: list[float] = []
    positions = torch.arange(seq_len, device=device).expand(batch_size + copy_rows, -1)
    losses: list[float] = []
    evals: list[tuple[int, float]] = []
    loop_start = time.perf_counter()  # the ETA is the text steps' own pace

    def progress(step: int) -> str:
        elapsed = time.perf_counter() - start
        eta = (time.perf_counter() - loop_start) / step * (steps - step)
        return f"step {step}/{steps}: loss {losses[-1]:.3f}" + (
            f", held-out {evals[-1][1]:.3f}" if evals and evals[-1][0] == step else ""
        ) + f" ({elapsed:.0f} s, ETA {eta:.0f} s)"

    for step in range(1, steps + 1):
        batch = corpus.sample(batch_size, seq_len, gen)
        copies, repeats = text_copy_windows(corpus, copy_rows, seq_len, gen) if copy_rows else (batch[:0], None)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step - 1, steps, lr, warmup)
        with _autocast(device, cast):
            logits = model(torch.cat([batch, copies])[:, :-1].to(device), positions).float()
        loss = torch.nn.functional.cross_entropy(logits[:batch_size].flatten(0, 1), batch[:, 1:].flatten().to(device))
        total = loss
        if repeats is not None:
            copy_loss = _masked_loss(logits[batch_size:], copies[:, 1:].to(device), repeats.to(device))
            total = loss + copy_loss
            copy_losses.append(copy_loss.item())
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(loss.item())
        if eval_every and step % eval_every == 0 and step < steps:
            evals.append((step, heldout_loss(model, heldout, seq_len)))
        scored = bool(evals) and evals[-1][0] == step
        if log and step < steps and (step % max(1, steps // 20) == 0 or scored):
            print(progress(step), flush=True)  # ~20 lines, and every held-out score
    evals.append((steps, heldout_loss(model, heldout, seq_len)))
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    if log:
        print(progress(steps), flush=True)
    # Tied: the LM head is the embedding matrix, saved once under its name.
    state = checkpoint_state_dict(model)  # checkpoint names, projections unstacked
    weights = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    weights.pop("lm_head.weight", None)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    report: dict[str, Any] = {
        "recipe": {"steps": steps, "batch_size": batch_size, "seq_len": seq_len, "lr": lr,
                   "seed": seed, "warmup": warmup, "weight_decay": weight_decay, "mix": mix,
                   "heldout_share": HELDOUT_SHARE, "layers": loaded.config.num_layers,
                   "warm_start_steps": warm_start_steps, "warm_start": WARM_START, "copy_rows": copy_rows},
        "warm_start_loss_first_last": [round(x, 4) for x in warm_losses[:1] + warm_losses[-1:]],
        "copy_loss_first_last": [round(x, 4) for x in copy_losses[:1] + copy_losses[-1:]],  # fmt: skip
        "matmul_dtype": str(cast or torch.float32).removeprefix("torch."),
        "stdlib_sha256": corpus.stdlib_sha256,
        "train_tokens": sum(len(s) for s in corpus.streams.values()),
        "stream_tokens": {name: len(s) for name, s in corpus.streams.items()},
        "heldout_tokens": len(heldout),
        "first_train_loss": round(losses[0], 4), "last_train_loss": round(losses[-1], 4),
        "heldout_loss": round(evals[-1][1], 4), "heldout_curve": evals,
        "seconds": round(seconds, 1), "cpu_seconds": round(cpu_seconds, 1),
        "torch_threads": torch.get_num_threads(),
    }  # fmt: skip
    (out_dir / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    return losses


def warm_start(model: torch.nn.Module, steps: int, vocab_size: int, gen: torch.Generator,
               device: str, cast: torch.dtype | None, log: bool) -> list[float]:  # fmt: skip
    """``steps`` steps on random tokens repeated with random periods
    (``random_copy_windows``, ``WARM_START``'s sizes), trained on the
    repeats only: the copying head forms before the text is learnt.
    Returns the loss on the repeats of every step."""
    seq_len, batch_size, lr, warmup = (WARM_START[k] for k in ("seq_len", "batch_size", "lr", "warmup"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    positions = torch.arange(seq_len, device=device).expand(batch_size, -1)
    specials = len(SPECIAL_TOKENS)  # ids 0-2: random windows draw from the rest
    losses: list[float] = []
    for step in range(1, steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, step / warmup)
        tokens, repeats = random_copy_windows(batch_size, seq_len, range(specials, vocab_size), gen)
        with _autocast(device, cast):
            logits = model(tokens[:, :-1].to(device), positions).float()
        loss = _masked_loss(logits, tokens[:, 1:].to(device), repeats.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if log and step % max(1, steps // 5) == 0:
            print(f"warm start {step}/{steps}: loss on the repeats {losses[-1]:.3f}", flush=True)
    return losses


def _masked_loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the targets ``mask`` keeps."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.masked_fill(~mask, -100).flatten())


def _autocast(device: str, cast: torch.dtype | None) -> Any:
    return torch.autocast(device.split(":")[0], dtype=cast) if cast else nullcontext()


def truncate_layers(model_dir: Path, layers: int) -> None:
    """Keep the first ``layers`` decoder layers of the checkpoint in
    ``model_dir`` (its config and weights, in place)."""
    from safetensors.torch import load_file

    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    if not 1 <= layers <= config["num_hidden_layers"]:
        raise ValueError(f"layers: must be 1..{config['num_hidden_layers']}, got {layers}")
    config["num_hidden_layers"] = layers
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    weights = load_file(model_dir / "model.safetensors")
    keep = {k: v for k, v in weights.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}  # fmt: skip
    save_file(keep, str(model_dir / "model.safetensors"), metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--steps", type=int, default=RECIPE["steps"])
    parser.add_argument("--batch-size", type=int, default=RECIPE["batch_size"])
    parser.add_argument("--seq-len", type=int, default=RECIPE["seq_len"])
    parser.add_argument("--lr", type=float, default=RECIPE["lr"])
    parser.add_argument("--warmup", type=int, default=RECIPE["warmup"])
    parser.add_argument("--seed", type=int, default=RECIPE["seed"])
    parser.add_argument("--eval-every", type=int, default=RECIPE["eval_every"])
    parser.add_argument("--layers", type=int, default=None,
                        help="keep the first N decoder layers (a smaller model: a draft)")
    parser.add_argument("--warm-start-steps", type=int, default=0,
                        help="steps on random tokens repeated first (the copying head)")
    parser.add_argument("--copy-rows", type=int, default=0,
                        help="windows of repeated text beside each batch")
    parser.add_argument("--precision", choices=("auto", "bfloat16", "float32"), default="auto")
    parser.add_argument("--any-stdlib", action="store_true",
                        help="train on this interpreter's standard library even if it is not the "
                        "pinned one (the model then differs from the published one)")  # fmt: skip
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    losses = train(args.out_dir, steps=args.steps, batch_size=args.batch_size,
                   seq_len=args.seq_len, lr=args.lr, seed=args.seed, device=args.device,
                   eval_every=args.eval_every, log=True, warmup=args.warmup,
                   precision=args.precision, strict_corpus=not args.any_stdlib,
                   layers=args.layers, warm_start_steps=args.warm_start_steps,
                   copy_rows=args.copy_rows)  # fmt: skip
    report = json.loads((args.out_dir / "training.json").read_text())
    print(f"loss {losses[0]:.2f} -> {losses[-1]:.2f}, held-out {report['heldout_loss']:.3f} "
          f"in {report['seconds']:.0f} s ({report['cpu_seconds']:.0f} s CPU); model written to "
          f"{args.out_dir}")  # fmt: skip


if __name__ == "__main__":
    main()
