"""Train the default model's architecture on its tokenizer's text, so that
demos print English-looking words and KV-cache accuracy is measured on a
model that has learnt something.

    python -m paged_server.default_model.train OUT_DIR [--steps N]

Writes a complete Hugging Face directory (the default model's files with
trained weights, and ``training.json``: the recipe, the last training loss
and the held-out loss) to OUT_DIR; serve it with ``paged-server --model
OUT_DIR``. ``paged_server.default_model.trained`` trains the evaluation
model (``--model trained-default``) with the fixed recipe and caches it.
Uses our own model code (plain PyTorch, causal attention without a cache),
a fixed seed and CPU by default.

Held-out text: the tail (~10%) of every help() page is never trained on
(``split_texts``); the held-out loss is the mean next-token cross-entropy
over its non-overlapping ``seq_len`` windows. (The tokenizer was trained on
all pages, which leaks word pieces, not text.)
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from paged_server.default_model import ensure_default_model
from paged_server.default_model.tokenizer_builder import ENDOFTEXT, training_texts
from paged_server.models import load_model
from paged_server.models.loader import checkpoint_state_dict


HELDOUT_SHARE = 0.1  # the last ~10% of every help() page, from a paragraph break on


def split_texts() -> tuple[list[str], list[str]]:
    """(training text, held-out text) of the tokenizer's pages, fixed: each
    page's tail from the last paragraph break before 90% of it is held out
    (whole pages would hold out a few short ones: 2% of the tokens), so the
    held-out text continues topics the model saw but is never trained on.
    The pages repeat some paragraphs word for word (the data model's, for
    instance): a held-out paragraph is dropped from every training page."""
    train_parts, heldout_parts = [], []
    for page in training_texts():
        cut = page.rfind("\n\n", 0, int(len(page) * (1 - HELDOUT_SHARE)))
        if cut <= 0:  # a page without a break early enough trains whole
            train_parts.append(page)
            continue
        train_parts.append(page[:cut])
        heldout_parts.append(page[cut:].strip())
    held = {p.strip() for part in heldout_parts for p in part.split("\n\n")}
    train_parts = [
        "\n\n".join(p for p in part.split("\n\n") if p.strip() not in held) for part in train_parts
    ]
    return train_parts, heldout_parts


def corpus_ids(tokenizer_dir: Path, texts: list[str] | None = None) -> torch.Tensor:
    """``texts`` (default: the training pages) as one id stream, pages
    separated by <|endoftext|>."""
    from paged_server.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tokenizer_dir)
    sep = tok.token_to_id(ENDOFTEXT)
    assert sep is not None, f"{ENDOFTEXT} missing from the default tokenizer"
    ids: list[int] = []
    for text in split_texts()[0] if texts is None else texts:
        ids += tok.encode(text, add_special_tokens=False) + [sep]
    return torch.tensor(ids)


def heldout_ids(tokenizer_dir: Path) -> torch.Tensor:
    """The held-out pages as one id stream (what the evaluation scores)."""
    return corpus_ids(tokenizer_dir, split_texts()[1])


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, ids: torch.Tensor, seq_len: int = 128,
                 batch_tokens: int = 2048) -> float:  # fmt: skip
    """Mean next-token cross-entropy (nats) over ``ids``' non-overlapping
    windows, ``batch_tokens`` tokens a forward pass."""
    batch_size = max(1, batch_tokens // seq_len)
    was_training = model.training
    model.eval()
    n = (len(ids) - 1) // seq_len
    windows = torch.stack([ids[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])
    positions = torch.arange(seq_len, device=ids.device)
    total = 0.0
    for start in range(0, n, batch_size):
        batch = windows[start : start + batch_size]
        logits = model(batch[:, :-1], positions.expand(batch.shape[0], -1))
        total += float(torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum"))  # fmt: skip
    model.train(was_training)
    return total / (n * seq_len)


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
) -> list[float]:
    """Train from the random default weights; returns the loss of every
    step and writes ``training.json`` (recipe, losses, held-out loss,
    seconds) beside the weights. ``eval_every``: also score the held-out
    text every that many steps (0: only at the end); ``log``: print progress
    (with each held-out score, or every twentieth of the run without them);
    ``source``: the random default model's directory (default: the cached one)."""
    source = source or ensure_default_model()
    out_dir.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        shutil.copy(file, out_dir / file.name)
    loaded = load_model(out_dir, torch.float32, device)
    model = loaded.model.train().requires_grad_(True)
    data = corpus_ids(out_dir).to(device)
    heldout = heldout_ids(out_dir).to(device)
    torch.manual_seed(seed)  # (nothing random happens outside ``gen`` today; kept fixed anyway)
    start = time.perf_counter()
    evals: list[tuple[int, float]] = []
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps)
    positions = torch.arange(seq_len, device=device).expand(batch_size, -1)
    losses = []
    for step in range(1, steps + 1):
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=gen)
        batch = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])
        logits = model(batch[:, :-1], positions)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if log and not eval_every and step % max(1, steps // 20) == 0:  # progress, ~20 lines
            print(f"step {step}/{steps}: train {losses[-1]:.3f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
        if eval_every and step % eval_every == 0 and step < steps:
            evals.append((step, heldout_loss(model, heldout, seq_len)))
            if log:
                print(f"step {step}: train {losses[-1]:.3f}, held-out {evals[-1][1]:.3f} "
                      f"({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
    evals.append((steps, heldout_loss(model, heldout, seq_len)))
    seconds = time.perf_counter() - start
    # Tied: the LM head is the embedding matrix, saved once under its name.
    state = checkpoint_state_dict(model)  # checkpoint names, projections unstacked
    weights = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    weights.pop("lm_head.weight", None)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    report = {
        "recipe": {"steps": steps, "batch_size": batch_size, "seq_len": seq_len, "lr": lr,
                   "seed": seed, "heldout_share": HELDOUT_SHARE},  # fmt: skip
        "train_tokens": len(data), "heldout_tokens": len(heldout),
        "first_train_loss": round(losses[0], 4), "last_train_loss": round(losses[-1], 4),
        "heldout_loss": round(evals[-1][1], 4), "heldout_curve": evals,
        "seconds": round(seconds, 1), "torch_threads": torch.get_num_threads(),
    }  # fmt: skip
    (out_dir / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    return losses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-every", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    losses = train(args.out_dir, steps=args.steps, batch_size=args.batch_size,
                   seq_len=args.seq_len, lr=args.lr, device=args.device,
                   eval_every=args.eval_every, log=True)  # fmt: skip
    report = json.loads((args.out_dir / "training.json").read_text())
    print(f"loss {losses[0]:.2f} -> {losses[-1]:.2f}, held-out {report['heldout_loss']:.3f} "
          f"in {report['seconds']:.0f} s; model written to {args.out_dir}")  # fmt: skip


if __name__ == "__main__":
    main()
