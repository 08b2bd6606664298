"""Seeded benchmark workloads: the same seed always gives the same requests.

Every workload is a single burst (all requests arrive at t=0) of token-id
prompts with a per-request ``max_tokens``; EOS is ignored so every backend
generates exactly the same number of tokens and throughput is comparable.

Prompt tokens are drawn from a *token pool* (ids the tokenizer can decode,
special tokens excluded), so the same workload runs on any model whose
tokenizer covers the pool. ``prompt_scale`` and ``new_tokens_scale`` shrink a
workload for slow machines while keeping the relative shape: the random draws
are the same, only multiplied.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, frozen=True)
class RequestSpec:
    """One request of a workload."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int


@dataclass(slots=True)
class Workload:
    """A named, seeded list of requests plus the parameters that made it."""

    name: str
    description: str
    seed: int
    requests: list[RequestSpec]
    params: dict[str, Any] = field(default_factory=dict)
    # Run to completion before the timed burst (e.g. to put a shared system
    # prompt in the prefix cache, as in a service that is already running).
    warmup: list[RequestSpec] = field(default_factory=list)

    @property
    def output_tokens(self) -> int:
        """Tokens the workload asks every backend to generate (EOS ignored)."""
        return sum(r.max_tokens for r in self.requests)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def max_model_len(self) -> int:
        """Longest prompt + generation of any request (what a contiguous row must hold)."""
        return max(len(r.prompt_token_ids) + r.max_tokens for r in self.requests)

    def summary(self) -> dict[str, Any]:
        """What a results page needs to say which workload was run."""
        prompts = [len(r.prompt_token_ids) for r in self.requests]
        outs = [r.max_tokens for r in self.requests]
        return {
            "name": self.name,
            "description": self.description,
            "seed": self.seed,
            "num_requests": len(self.requests),
            "prompt_tokens": {
                "min": min(prompts),
                "max": max(prompts),
                "mean": round(statistics.fmean(prompts), 1),
                "total": sum(prompts),
            },
            "max_tokens": {
                "min": min(outs),
                "max": max(outs),
                "mean": round(statistics.fmean(outs), 1),
                "total": sum(outs),
            },
            "params": dict(self.params),
            "warmup_requests": len(self.warmup),
        }


def token_pool_from_tokenizer(tokenizer: Any, model_vocab_size: int | None = None) -> list[int]:
    """Every id the tokenizer knows except its special tokens (BOS/EOS/pad...),
    below ``model_vocab_size`` when given.

    Prompts drawn from this pool never contain an EOS or a chat-template
    marker, and decode to text on every backend. Takes our ``Tokenizer``
    (``vocab_size``, ``special_token_ids``) or a transformers tokenizer
    (``len``, ``all_special_ids``)."""
    if hasattr(tokenizer, "special_token_ids"):
        size, special = int(tokenizer.vocab_size), set(tokenizer.special_token_ids)
    else:
        size, special = len(tokenizer), set(getattr(tokenizer, "all_special_ids", []) or [])
    if model_vocab_size is not None:
        size = min(size, model_vocab_size)
    pool = [i for i in range(size) if i not in special]
    if not pool:
        raise ValueError("the tokenizer has no non-special tokens to build prompts from")
    return pool


def _scaled(value: int, scale: float) -> int:
    return max(1, round(value * scale))


def _draw_prompt(rng: random.Random, pool: Sequence[int], n: int) -> tuple[int, ...]:
    return tuple(pool[rng.randrange(len(pool))] for _ in range(n))


def _check(num_requests: int, pool: Sequence[int], *ranges: tuple[int, int]) -> None:
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if not pool:
        raise ValueError("token pool is empty")
    for lo, hi in ranges:
        if not 1 <= lo <= hi:
            raise ValueError(f"length range ({lo}, {hi}) must satisfy 1 <= lo <= hi")


def burst_workload(
    name: str,
    description: str,
    pool: Sequence[int],
    *,
    num_requests: int,
    prompt_range: tuple[int, int],
    new_tokens_range: tuple[int, int],
    seed: int = 0,
    prompt_scale: float = 1.0,
    new_tokens_scale: float = 1.0,
) -> Workload:
    """``num_requests`` independent random prompts, lengths uniform in the ranges."""
    _check(num_requests, pool, prompt_range, new_tokens_range)
    # Lengths and token ids come from separate streams, so scaling the prompts
    # leaves every request's length draws unchanged.
    rng, token_rng = random.Random(seed), random.Random(f"{seed}:tokens")
    requests = []
    for i in range(num_requests):
        prompt_len = _scaled(rng.randint(*prompt_range), prompt_scale)
        max_tokens = _scaled(rng.randint(*new_tokens_range), new_tokens_scale)
        prompt = _draw_prompt(token_rng, pool, prompt_len)
        requests.append(RequestSpec(f"{name}-{i}", prompt, max_tokens))
    params = {
        "prompt_range": list(prompt_range),
        "new_tokens_range": list(new_tokens_range),
        "prompt_scale": prompt_scale,
        "new_tokens_scale": new_tokens_scale,
    }
    return Workload(name, description, seed, requests, params)


def _burst_preset(
    name: str,
    description: str,
    default_requests: int,
    prompt_range: tuple[int, int],
    new_tokens_range: tuple[int, int],
    doc: str,
) -> Callable[..., Workload]:
    """A ``burst_workload`` with its name and ranges fixed: the caller picks
    the request count (``default_requests`` when not given), seed and scales."""

    def preset(
        pool: Sequence[int],
        *,
        num_requests: int = default_requests,
        seed: int = 0,
        prompt_scale: float = 1.0,
        new_tokens_scale: float = 1.0,
    ) -> Workload:
        return burst_workload(
            name,
            description,
            pool,
            num_requests=num_requests,
            prompt_range=prompt_range,
            new_tokens_range=new_tokens_range,
            seed=seed,
            prompt_scale=prompt_scale,
            new_tokens_scale=new_tokens_scale,
        )

    preset.__name__ = preset.__qualname__ = f"{name}_workload"
    preset.__doc__ = doc
    return preset


seed_workload = _burst_preset(
    "seed",
    "paged_attention seed workload: one burst, prompts 128-384, 128-256 new tokens",
    48,
    (128, 384),
    (128, 256),
    """The ``paged_attention`` seed workload: 48 requests in one
    burst, prompts 128-384 tokens, 128-256 new tokens, EOS ignored.

    Every request fits in 640 tokens, so at 8 x 4,096 token slots of KV memory
    all 48 fit at once in a paged pool while a contiguous pool holds 8.""",
)

nano_vllm_workload = _burst_preset(
    "nano_vllm",
    "nano-vllm bench: one burst, prompts 100-1024, 100-1024 new tokens",
    256,
    (100, 1024),
    (100, 1024),
    """nano-vllm's ``bench.py`` shape: 256 requests, prompts and outputs each
    uniform in 100-1,024 tokens, random token ids, one burst.""",
)


def _system_prompt_workload(
    name: str,
    pool: Sequence[int],
    *,
    num_requests: int,
    num_groups: int,
    system_prompt_tokens: int,
    shared: bool,
    suffix_range: tuple[int, int] = (16, 64),
    new_tokens_range: tuple[int, int] = (16, 32),
    seed: int = 0,
    prompt_scale: float = 1.0,
    new_tokens_scale: float = 1.0,
) -> Workload:
    """``num_groups`` system prompts, request ``i`` a distinct suffix after
    prompt ``i % num_groups``. ``shared``: one prompt (``num_groups`` 1),
    and one more request after it runs before the burst (a service that has
    already seen it)."""
    _check(num_requests, pool, (system_prompt_tokens, system_prompt_tokens), suffix_range, new_tokens_range)
    rng, token_rng = random.Random(seed), random.Random(f"{seed}:tokens")
    systems = [
        _draw_prompt(token_rng, pool, _scaled(system_prompt_tokens, prompt_scale)) for _ in range(num_groups)
    ]

    def request(request_id: str, system: tuple[int, ...]) -> RequestSpec:
        suffix = _draw_prompt(token_rng, pool, _scaled(rng.randint(*suffix_range), prompt_scale))
        max_tokens = _scaled(rng.randint(*new_tokens_range), new_tokens_scale)
        return RequestSpec(request_id, system + suffix, max_tokens)

    requests = [request(f"{name}-{i}", systems[i % num_groups]) for i in range(num_requests)]
    warmup = [request(f"{name}-warmup", systems[0])] if shared else []
    params = {} if shared else {"num_groups": num_groups}
    params |= {
        "system_prompt_tokens": len(systems[0]),
        "suffix_range": list(suffix_range),
        "new_tokens_range": list(new_tokens_range),
        "prompt_scale": prompt_scale,
        "new_tokens_scale": new_tokens_scale,
    }
    prompts = (
        f"shared system prompt ({len(systems[0])} tokens)"
        if shared
        else f"{num_groups} system prompts ({len(systems[0])} tokens) taking turns"
    )
    description = (
        f"{prompts} + distinct {suffix_range[0]}-{suffix_range[1]} token suffix, "
        f"{new_tokens_range[0]}-{new_tokens_range[1]} new tokens"
        + (", after one warm-up request" if shared else "")
    )
    return Workload(name, description, seed, requests, params, warmup)


def shared_prefix_workload(
    pool: Sequence[int], *, num_requests: int = 32, system_prompt_tokens: int = 384, **knobs: Any
) -> Workload:
    """One system prompt shared by every request, then a short distinct user
    part: what prefix caching is for (chat with a fixed system prompt). One
    warm-up request with the same system prompt runs before the timed burst,
    as in a service that has already seen it; without it a burst has no
    computed blocks to hit. ``knobs``: ``suffix_range`` (16, 64),
    ``new_tokens_range`` (16, 32), ``seed``, ``prompt_scale``, ``new_tokens_scale``."""
    return _system_prompt_workload(
        "shared_prefix", pool, num_requests=num_requests, num_groups=1,
        system_prompt_tokens=system_prompt_tokens, shared=True, **knobs,
    )


def prefix_groups_workload(
    pool: Sequence[int],
    *,
    num_requests: int = 64,
    num_groups: int = 4,
    system_prompt_tokens: int = 256,
    **knobs: Any,
) -> Workload:
    """``num_groups`` system prompts (tenants), requests taking turns among
    them, each a distinct suffix after its group's prompt: what prefix-aware
    routing across data-parallel replicas is for (a replica that saw a
    group's prompt serves its next requests from its prefix cache).
    ``knobs``: as ``shared_prefix_workload``'s."""
    return _system_prompt_workload(
        "prefix_groups", pool, num_requests=num_requests, num_groups=num_groups,
        system_prompt_tokens=system_prompt_tokens, shared=False, **knobs,
    )


WORKLOADS = {
    "seed": seed_workload,
    "nano_vllm": nano_vllm_workload,
    "shared_prefix": shared_prefix_workload,
    "prefix_groups": prefix_groups_workload,
}


def make_workload(
    name: str,
    pool: Sequence[int],
    *,
    num_requests: int | None = None,
    seed: int = 0,
    prompt_scale: float = 1.0,
    new_tokens_scale: float = 1.0,
) -> Workload:
    """Build a workload by name (``seed``, ``nano_vllm``, ``shared_prefix``, ``prefix_groups``)."""
    try:
        factory = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)}") from None
    kwargs: dict[str, Any] = {
        "seed": seed,
        "prompt_scale": prompt_scale,
        "new_tokens_scale": new_tokens_scale,
    }
    if num_requests is not None:
        kwargs["num_requests"] = num_requests
    return factory(pool, **kwargs)  # type: ignore[operator]
