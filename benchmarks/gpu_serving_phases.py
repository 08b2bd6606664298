"""The phases of ``gpu_serving.py``, one function each: ``phase(work_dir, shape, tiny)``.

Each runs in its own process and merges what it measured into
``work_dir/<phase>.json`` after every measurement, so a phase stopped at
its time limit still reports what it finished.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

# Dense bf16 tensor-core peaks (FLOP/s, no sparsity) by device name: the FLOP roofline.
PEAK_BF16 = {"H200": 989e12, "H100 SXM": 989e12, "H100 80GB HBM3": 989e12, "H100 PCIe": 756e12,
             "H100 NVL": 835e12, "A100": 312e12, "L40S": 362e12, "RTX 4090": 165e12,
             "A10": 125e12, "L4": 121e12}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Shape:
    """A Llama's shape and the run's sizes: decode at ``streams`` of
    ``context``-token prompts generating ``new_tokens`` each; TTFT of
    ``ttft_prompt``-token prompts, ``ttft_repeats`` times."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    streams: tuple[int, ...]
    context: int
    new_tokens: int
    ttft_prompt: int
    ttft_repeats: int

    def describe(self) -> dict[str, Any]:
        return {**asdict(self), "parameters": self.parameters(), "dtype": "bfloat16"}

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """Every weight's name and shape, as a Llama checkpoint stores them."""
        h, i, d = self.hidden, self.intermediate, self.head_dim
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, h)}
        for n in range(self.layers):
            p = f"model.layers.{n}."
            out |= {p + "self_attn.q_proj.weight": (self.heads * d, h),
                    p + "self_attn.k_proj.weight": (self.kv_heads * d, h),
                    p + "self_attn.v_proj.weight": (self.kv_heads * d, h),
                    p + "self_attn.o_proj.weight": (h, self.heads * d),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i),
                    p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}  # fmt: skip
        out |= {"model.norm.weight": (h,), "lm_head.weight": (self.vocab, h)}
        return out

    def parameters(self) -> int:
        return sum(_numel(s) for s in self.tensors().values())

    def matmul_parameters(self) -> int:
        """Weights every token multiplies by (all but the embedding, a gather)."""
        return self.parameters() - self.vocab * self.hidden

    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2  # K and V, bf16

    def config(self, bos: int | None, eos: int | None) -> dict[str, Any]:
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": self.hidden, "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "rope_scaling": {
                "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
            "bos_token_id": bos, "eos_token_id": eos,
        }  # fmt: skip


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Part:
    """This phase's results file, rewritten after each measurement."""

    def __init__(self, work: Path, phase: str) -> None:
        self.path = work / f"{phase}.json"
        self.data: dict[str, Any] = {}

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.path.write_text(json.dumps(self.data, indent=2))

    def merge(self, key: str, sub: str, value: Any) -> None:
        self.put(key, {**self.data.get(key, {}), sub: value})


def model_dir(work: Path) -> Path:
    return work / "model"


# -- 1. the checkpoint ------------------------------------------------------------------


def phase_checkpoint(work: Path, shape: Shape, tiny: bool) -> None:
    """Random bf16 weights made on the device, written once (a marker file
    says the directory is complete and for which shape)."""
    from safetensors.torch import save_file

    from paged_server.default_model import ensure_default_model

    target = model_dir(work)
    stamp = json.dumps(shape.describe(), sort_keys=True)
    part = Part(work, "checkpoint")
    if torch.cuda.is_available():
        part.put("device", torch.cuda.get_device_name())
    if (target / "complete.json").is_file() and (target / "complete.json").read_text() == stamp:
        part.put("checkpoint", {"reused": True, "path": str(target)})
        return
    start = time.perf_counter()
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    tok_dir = ensure_default_model()  # the embedded model's tokenizer: built locally
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tok_dir / name, target / name)
    tok_cfg = json.loads((tok_dir / "config.json").read_text())
    bos, eos = tok_cfg.get("bos_token_id"), tok_cfg.get("eos_token_id")
    (target / "config.json").write_text(json.dumps(shape.config(bos, eos), indent=2))
    gen = torch.Generator(_device()).manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    index: dict[str, str] = {}
    limit = 4 << 30  # bytes per shard, as published checkpoints split them
    size = 0
    for name, dims in shape.tensors().items():
        if "norm" in name:
            t = torch.ones(dims, dtype=torch.bfloat16, device=_device())
        else:
            t = torch.randn(dims, generator=gen, dtype=torch.bfloat16, device=_device()) * 0.02
        if size and size + t.numel() * 2 > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.numel() * 2
    made = time.perf_counter() - start
    for n, shard in enumerate(shards):
        file = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: v.cpu() for k, v in shard.items()}, str(target / file), {"format": "pt"})
        index |= {k: file for k in shard}
        shard.clear()
    (target / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": shape.parameters() * 2}, "weight_map": index})
    )
    (target / "complete.json").write_text(stamp)
    part.put("checkpoint", {"reused": False, "path": str(target), "made_s": round(made, 2),
                            "written_s": round(time.perf_counter() - start - made, 2)})  # fmt: skip


# -- 2. LLM: bandwidth, the prefill kernel, decode and TTFT against the roofline --------


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s a device-to-device copy moves (bytes read + bytes written):
    the HBM bandwidth the roofline divides by, measured in this run."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    best = float("inf")
    for _ in range(10):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 FLOP/s: ``PAGED_PEAK_TFLOPS``, else by device name (None on CPU)."""
    import os

    if os.environ.get("PAGED_PEAK_TFLOPS"):
        return float(os.environ["PAGED_PEAK_TFLOPS"]) * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16.items() if key in name), None)


def prefill_kernel_vs_sdpa(shape: Shape, tiny: bool) -> dict[str, Any]:
    """TFLOP/s of the Triton prefill kernel over TFLOP/s of torch's SDPA on the
    same queries and keys stored densely (FlashAttention on a GPU): 8 x 2k
    prompts, and 512-token chunks after 8k cached tokens (SDPA with a
    lower-right causal mask)."""
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from paged_triton import kernel_bench
    from paged_triton.ops import paged_prefill_attention

    device = _device()
    layout = dict(heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim, block_size=16)
    cases = {"prompts-8x2k": ([2048] * 8, [2048] * 8),
             "chunks-4x512-after-8k": ([8704] * 4, [512] * 4)}  # fmt: skip
    if tiny:
        cases = {"prompts-8x2k": ([32] * 2, [32] * 2), "chunks-4x512-after-8k": ([48] * 2, [16] * 2)}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out: dict[str, Any] = {}
    for name, (contexts, new) in cases.items():
        step = kernel_bench.prefill_step(contexts, new, **layout, dtype=dtype, device=device)
        flops = kernel_bench.causal_flops(contexts, new, shape.heads, shape.head_dim)
        memo: dict[Any, Any] = {}

        def ours(step: Any = step, memo: dict[Any, Any] = memo) -> Any:
            return paged_prefill_attention(
                step.q, step.k_cache, step.v_cache, step.block_tables, step.cu_seqlens_q,
                step.seq_lens, step.scale, memo=memo,
            )  # fmt: skip

        b, q_len, kv_len = len(contexts), new[0], contexts[0]
        g = shape.heads // shape.kv_heads
        q = step.q.view(b, q_len, shape.heads, shape.head_dim).transpose(1, 2)
        k = torch.randn(b, shape.kv_heads, kv_len, shape.head_dim, device=device, dtype=dtype)
        k = k.repeat_interleave(g, 1)
        mask = causal_lower_right(q_len, kv_len)

        def theirs(q: Any = q, k: Any = k, mask: Any = mask, scale: float = step.scale) -> Any:
            return sdpa(q, k, k, attn_mask=mask, scale=scale)

        ms_ours, ms_sdpa = kernel_bench.kernel_ms(ours, device), kernel_bench.kernel_ms(theirs, device)
        out[name] = {"triton_tflops": flops / ms_ours / 1e9, "sdpa_tflops": flops / ms_sdpa / 1e9,
                     "ratio": ms_sdpa / ms_ours, "ms": ms_ours, "tile": str(table_tile(step))}  # fmt: skip
        if device.type == "cuda" and os.environ.get("PAGED_GPU_TUNE_PREFILL") == "1":
            out[name]["tuned"] = tune_prefill(ours, device)
        del step, q, k
    return out


def table_tile(step: Any) -> Any:
    """The prefill tile ``tile_config`` gives this step's layout on this device."""
    import triton

    from paged_triton.launch import device_arch
    from paged_triton.tile_config import MIN_DOT, tile_config

    block_d = max(MIN_DOT, triton.next_power_of_2(step.q.shape[2]))
    return tile_config("prefill", block_d, step.q.dtype, device_arch(step.q.device))


def tune_prefill(ours: Any, device: torch.device) -> dict[str, Any]:
    """``PAGED_GPU_TUNE_PREFILL=1``: time every prefill candidate tile
    (``tile_config.candidates``, ~24 compiles: a minute or two) on this
    step; the winners (the autotune table: copy one into ``PREFILL_TILES``
    once the compile matrix shows it without spills on its GPU class) and
    the winner's ms, to set against the table tile's."""
    from paged_triton import kernel_bench
    from paged_triton.tile_config import tuned_tiles

    memo: dict[Any, Any] = {}
    os.environ["PAGED_TRITON_AUTOTUNE"] = "1"
    try:
        ours(memo=memo)  # a shape's first call times the candidates, then plans the winner
    finally:
        del os.environ["PAGED_TRITON_AUTOTUNE"]
    winners = {key: str(tile) for key, tile in tuned_tiles("prefill").items()}
    return {"winners": winners, "ms": kernel_bench.kernel_ms(lambda: ours(memo=memo), device)}


def _prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    """``n`` distinct random prompts (no prefix-cache hits between them)."""
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(length)] for _ in range(n)]


def tokenizer_vocab(work: Path) -> int:
    """Ids the checkpoint's tokenizer can decode (prompts are drawn below it)."""
    data = json.loads((model_dir(work) / "tokenizer.json").read_text())
    return len(data["model"]["vocab"])


def run_streams(engine: Any, prompts: list[list[int]], new_tokens: int, tag: str = "") -> dict[str, float]:
    """All prompts at once, greedy, EOS ignored: total output tokens/s, and
    decode tokens/s from the moment every stream has its first token."""
    from paged_server.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for n, ids in enumerate(prompts):
        engine.add_request(f"s{len(prompts)}{tag}-{n}", ids, params)
    first: dict[str, float] = {}
    produced = after_first = 0
    all_first = None
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.finish_reason == "error":
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            got = len(out.new_token_ids)
            produced += got
            if all_first is not None:
                after_first += got
            elif got:
                first.setdefault(out.request_id, now)
        if all_first is None and len(first) == len(prompts):
            all_first = now
    end = time.perf_counter()
    if produced != new_tokens * len(prompts):
        raise RuntimeError(f"produced {produced} tokens, asked {new_tokens * len(prompts)}")
    decode_s = end - all_first if all_first is not None else 0.0
    return {"output_tokens_per_s": produced / (end - start), "seconds": end - start,
            "decode_tokens_per_s": after_first / decode_s if decode_s > 0 else None,
            "ttft_p50_ms": 1e3 * statistics.median(t - start for t in first.values())}  # fmt: skip


def phase_llm(work: Path, shape: Shape, tiny: bool) -> None:
    """Bandwidth, the prefill kernel, then ``LLM`` with the GPU defaults."""
    from paged_server.entrypoints.llm import LLM

    device = _device()
    part = Part(work, "llm")
    bandwidth = copy_bandwidth(device, (2 << 30) if not tiny else (16 << 20))
    part.put("hbm_bandwidth_GBps", round(bandwidth / 1e9, 1))
    part.put("prefill_kernel", prefill_kernel_vs_sdpa(shape, tiny))
    part.put("prefill_kernel_vs_sdpa", {k: v["ratio"] for k, v in part.data["prefill_kernel"].items()})
    if device.type == "cuda":
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    # A GPU user's defaults; only the batch (256 streams) and the longest sequence are set.
    kwargs: dict[str, Any] = dict(max_batch_size=max(shape.streams), max_model_len=4096)
    if tiny:  # CPU: the Triton kernels in the interpreter, the path a GPU takes
        kwargs |= dict(max_model_len=256, attention_backend="triton", dtype="float32")
    llm = LLM(str(model_dir(work)), **kwargs)
    engine = llm.engine
    part.put("llm_start_s", round(time.perf_counter() - t0, 1))
    part.put("engine", {k: str(v) for k, v in _resolved(engine).items()})
    vocab = tokenizer_vocab(work)
    weight_bytes = shape.matmul_parameters() * 2
    for s in shape.streams:
        prompts = _prompts(s, shape.context, seed=s, vocab=vocab)
        m = run_streams(engine, prompts, shape.new_tokens)  # cold: what transformers is set against
        # Decode at s streams: the same prompts again, now prefix-cache hits, so every
        # stream has its first token after one step and all s decode together. (In the
        # cold run chunked prefill staggers them: early streams finish while late ones
        # still prefill, and the steps counted hold fewer than s streams.)
        warm = run_streams(engine, prompts, shape.new_tokens, tag="-again")
        m |= {"cold_decode_tokens_per_s": m["decode_tokens_per_s"],
              "decode_tokens_per_s": warm["decode_tokens_per_s"],
              "prefix_hit_ttft_p50_ms": warm["ttft_p50_ms"]}  # fmt: skip
        # Each decode step reads every weight once and each stream's KV (mean context).
        context = shape.context + shape.new_tokens / 2
        step_bytes = weight_bytes + s * context * shape.kv_bytes_per_token()
        roofline = s * bandwidth / step_bytes
        m |= {"roofline_tokens_per_s": roofline, "bytes_per_step": step_bytes,
              "roofline_fraction": m["decode_tokens_per_s"] / roofline
              if m["decode_tokens_per_s"] else None}  # fmt: skip
        if s == 1 and m["decode_tokens_per_s"]:
            m["itl_over_weight_read"] = bandwidth / weight_bytes / m["decode_tokens_per_s"]
        part.merge("decode", str(s), m)
    ttfts = []
    for ids in _prompts(shape.ttft_repeats, shape.ttft_prompt, seed=99, vocab=vocab):
        ttfts.append(run_streams(engine, [ids], 1)["ttft_p50_ms"])
    flops = 2 * shape.matmul_parameters() * shape.ttft_prompt + shape.layers * 4 * shape.heads * \
        shape.head_dim * shape.ttft_prompt * (shape.ttft_prompt + 1) / 2  # fmt: skip
    peak = peak_flops(device)
    p50 = statistics.median(ttfts)
    part.put("ttft_2k", {"prompt_tokens": shape.ttft_prompt, "p50_ms": p50, "all_ms": ttfts,
                         "flops": flops, "roofline_ms": flops / peak * 1e3 if peak else None,
                         "roofline_fraction": flops / peak * 1e3 / p50 if peak else None})  # fmt: skip
    # Where a decode step's time goes (torch.profiler), at one stream and at the most
    # up to 64: the next GPU session reads what bounds the step off this.
    from gpu_step_profile import profile_decode_steps

    for s in sorted({min(shape.streams), max(x for x in shape.streams if x <= 64)}):
        prompts = _prompts(s, shape.context, seed=s, vocab=vocab)  # cached since the sweep
        steps = 8 if not tiny else 2  # the interpreter's steps are slow; the path is what is checked
        part.merge("step_profile", str(s), profile_decode_steps(engine, prompts, steps, f"-{s}"))
    llm.shutdown()


def _resolved(engine: Any) -> dict[str, Any]:
    """What the engine resolved the defaults to (backend, graphs, pool size)."""
    cfg = engine.config
    out = {f: getattr(cfg, f, None) for f in ("attention_backend", "enforce_eager",
           "enable_prefix_caching", "enable_chunked_prefill", "gpu_memory_utilization",
           "max_num_batched_tokens")}  # fmt: skip
    resolved = getattr(engine, "resolved", None)
    if isinstance(resolved, dict):
        out |= resolved
    out["kv_blocks"] = getattr(engine.kv_manager, "num_blocks", None)
    return out


# -- 3. serve ---------------------------------------------------------------------------


def phase_serve(work: Path, shape: Shape, tiny: bool) -> None:
    """``paged-server serve`` on the checkpoint with its defaults; streamed
    completions from concurrent clients; a repeated prompt's TTFT (a prefix hit)."""
    part = Part(work, "serve")
    cmd = [sys.executable, "-m", "paged_server.entrypoints.cli", "serve", "--model",
           str(model_dir(work)), "--port", "0", "--max-model-len", "4096"]  # fmt: skip
    if tiny:
        cmd += ["--attention-backend", "triton", "--dtype", "float32", "--max-model-len", "256"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        url = _server_url(proc)
        part.put("serve_start_s", round(time.perf_counter() - t0, 1))
        name = json.loads(urllib.request.urlopen(url + "/v1/models").read())["data"][0]["id"]
        vocab = tokenizer_vocab(work)
        streams = 16 if not tiny else 2
        prompts = _prompts(streams, shape.context, seed=7, vocab=vocab)
        results: list[dict[str, float]] = [{} for _ in prompts]
        start = time.perf_counter()
        threads = [threading.Thread(target=lambda i=i, p=p: results.__setitem__(
            i, _stream(url, name, p, shape.new_tokens))) for i, p in enumerate(prompts)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        tokens = sum(r.get("tokens", 0) for r in results)
        part.put("serve", {"streams": streams, "output_tokens": tokens,
                           "output_tokens_per_s": tokens / wall,
                           "ttft_p50_ms": statistics.median(r["ttft_ms"] for r in results)})  # fmt: skip
        long = _prompts(1, shape.ttft_prompt, seed=11, vocab=vocab)[0]
        cold, warm = _stream(url, name, long, 1), _stream(url, name, long, 1)
        part.merge("serve", "ttft_2k_cold_ms", cold["ttft_ms"])
        part.merge("serve", "ttft_2k_prefix_hit_ms", warm["ttft_ms"])
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _server_url(proc: subprocess.Popen[str]) -> str:
    assert proc.stderr is not None
    lines = []
    while True:
        line = proc.stderr.readline()
        if not line:
            raise RuntimeError("serve exited before it was ready:\n" + "".join(lines[-30:]))
        lines.append(line)
        if m := re.search(r"serving '.*' \(.*\) on (http://\S+) ", line):
            url = m.group(1)
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # type: ignore[union-attr]
            break
    for _ in range(600):
        try:
            if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                return url
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url}/health never answered 200")


def _stream(url: str, model: str, ids: list[int], max_tokens: int) -> dict[str, float]:
    """One streamed completion: time to its first token, tokens received."""
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": max_tokens, "stream": True,
                       "temperature": 0.0, "ignore_eos": True,
                       "stream_options": {"include_usage": True}}).encode()  # fmt: skip
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    start = time.perf_counter()
    ttft = None
    tokens = 0
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and ttft is None:
                ttft = (time.perf_counter() - start) * 1e3
    return {"ttft_ms": ttft if ttft is not None else float("nan"), "tokens": tokens}


# -- 4. transformers --------------------------------------------------------------------


def _hf_model(work: Path) -> Any:
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return AutoModelForCausalLM.from_pretrained(str(model_dir(work)), dtype=dtype).to(_device()).eval()


def phase_hf_batch(work: Path, shape: Shape, tiny: bool) -> None:
    """transformers' ``generate_batch`` (continuous batching) on the decode
    sweep's very requests, when this transformers has it."""
    from paged_server.bench.hf_baseline import run_hf_continuous
    from paged_server.bench.workloads import RequestSpec, Workload

    part = Part(work, "hf_batch")
    model = _hf_model(work)
    if not hasattr(model, "generate_batch"):
        import transformers

        part.put("hf_generate_batch_missing", f"transformers {transformers.__version__} has no "
                 "generate_batch (continuous batching); only static generate is compared")  # fmt: skip
        return
    vocab = tokenizer_vocab(work)
    for s in shape.streams:
        prompts = _prompts(s, shape.context, seed=s, vocab=vocab)
        reqs = [RequestSpec(f"r{n}", tuple(p), shape.new_tokens) for n, p in enumerate(prompts)]
        workload = Workload(f"streams-{s}", "decode sweep", s, reqs)
        tokens = s * (shape.context + shape.new_tokens) + 16 * s
        r = run_hf_continuous(model, workload, kv_tokens=tokens, max_batch_size=s,
                              max_batched_tokens=max(8192, shape.context))  # fmt: skip
        part.merge("hf_generate_batch", str(s), {"output_tokens_per_s": r.tokens_per_s,
                                                 "seconds": r.seconds, "ttft_ms": r.ttft_ms})  # fmt: skip


def phase_hf_static(work: Path, shape: Shape, tiny: bool) -> None:
    """transformers' static-cache ``generate``, one stream: TTFT of a 2k
    prompt and the inter-token latency after it."""
    part = Part(work, "hf_static")
    model = _hf_model(work)
    ids = torch.tensor([_prompts(1, shape.ttft_prompt, seed=99, vocab=tokenizer_vocab(work))[0]],
                       device=_device())  # fmt: skip
    clock = _Clock()
    runs = []
    for _ in range(2):  # the first compiles (static cache: transformers compiles the forward)
        clock.times.clear()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=shape.new_tokens, min_new_tokens=shape.new_tokens,
                           do_sample=False, cache_implementation="static", streamer=clock,
                           pad_token_id=0)  # fmt: skip
        steps = clock.times[1:]  # [0]: the prompt
        itl = [b - a for a, b in zip(steps, steps[1:], strict=False)]
        runs.append({"ttft_ms": (steps[0] - start) * 1e3,
                     "itl_ms": statistics.median(itl) * 1e3 if itl else None})  # fmt: skip
        part.put("hf_static", {**runs[-1], "runs": runs, "prompt_tokens": shape.ttft_prompt})


class _Clock:
    """A ``generate`` streamer that notes when each step's tokens arrive."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


PHASES: dict[str, Callable[[Path, Shape, bool], None]] = {
    "checkpoint": phase_checkpoint,
    "llm": phase_llm,
    "serve": phase_serve,
    "hf_batch": phase_hf_batch,
    "hf_static": phase_hf_static,
}
