"""Checks the engine runs at its edges: on a prompt before it is queued,
and on engine + pool bookkeeping when asked for an audit."""

from __future__ import annotations

from paged_core.protocols import KVCacheManagerProtocol
from paged_server.engine.core.scheduler import Scheduler
from paged_server.engine.kv.pool_factory import PoolCapacity
from paged_server.errors import ContextLengthError
from paged_server.models import ModelConfig
from paged_server.sampling_params import SamplingParams


def check_priority(priority: object, policy: str) -> None:
    """A request's ``priority``: an integer, and 0 unless the engine schedules
    by priority (vLLM refuses a nonzero one under fcfs the same way)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority: must be an integer, got {priority!r}")
    if priority != 0 and policy != "priority":
        raise ValueError(
            f"priority: got {priority} but priority scheduling is not enabled (the scheduling "
            f"policy is {policy}); start with --scheduling-policy priority, or send 0"
        )


def check_prompt(
    token_ids: list[int],
    params: SamplingParams,
    max_model_len: int,
    model_config: ModelConfig,
    capacity: PoolCapacity,
    max_batch_size: int,
) -> None:
    """Reject at submission what could never run, rather than after it waited:
    more choices (``n``) than ``max_batch_size`` (admission needs all ``n``
    places at once, so such a request would wait forever and, the queue being
    first come first served, hold up every request behind it), empty prompts,
    ids outside the vocabulary (prompt, logit_bias, stop_token_ids), prompts
    leaving no room for a generated token, and (paged) sequences that alone
    need more blocks than the whole pool has."""
    if params.num_seqs > max_batch_size:
        name = "best_of" if params.use_beam_search else "n"
        raise ValueError(
            f"{name}: must be <= {max_batch_size} (max_batch_size), got {params.num_seqs}; all "
            f"{params.num_seqs} choices or beams run at once, so this request could never start: "
            "ask for fewer or raise max_batch_size"
        )
    n = len(token_ids)
    if n == 0:
        raise ValueError("prompt: must not be empty (after tokenisation)")
    vocab = model_config.vocab_size
    bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"prompt: token id {bad!r} is outside the vocabulary (0..{vocab - 1})")
    biased = next((t for t in params.logit_bias or {} if t >= vocab), None)
    if biased is not None:
        raise ValueError(
            f"logit_bias: token id {biased} is outside the vocabulary (0..{vocab - 1})"
        )
    # vLLM refuses these too; one could never be generated, so it would never stop anything
    stops = [t for t in params.stop_token_ids if t >= vocab]
    if stops:
        raise ValueError(
            f"stop_token_ids: token id(s) {stops} are outside the vocabulary of {vocab} tokens "
            f"(0..{vocab - 1})"
        )
    if n >= max_model_len:
        raise ContextLengthError(
            f"prompt: prompt has {n} tokens but max_model_len is {max_model_len} "
            f"(the prompt and at least one generated token must fit); shorten the prompt to "
            f"at most {max_model_len - 1} tokens"
        )
    if capacity.num_rows is None:  # paged: must fit the pool on its own
        kv_tokens = min(n + params.max_tokens, max_model_len) - 1  # the last token is never written
        blocks = capacity.blocks_for(n, kv_tokens)  # over every KV cache group
        total = capacity.num_blocks
        if blocks > total:
            raise ValueError(
                f"prompt has {n} tokens and max_tokens is {params.max_tokens}: the sequence "
                f"needs {blocks} KV blocks but the cache has {total} in total; "
                "lower max_tokens or raise num_gpu_blocks / kv_cache_memory_bytes"
            )
        # Beams run as one unit (admitted, preempted and readmitted together),
        # so all of them must fit at once (sharing usually makes it far less,
        # but a readmitted unit holds each beam's history apart).
        beams = params.beam_width
        if beams > 1 and beams * blocks > total:
            raise ValueError(
                f"best_of: beam search of width {beams} over {blocks} KV blocks per beam needs up to "
                f"{beams * blocks} blocks but the cache has {total}; lower "
                "best_of or max_tokens, or raise num_gpu_blocks / kv_cache_memory_bytes"
            )


def check_pool(capacity: PoolCapacity, max_model_len: int) -> str | None:
    """At start-up: refuse a paged pool that holds no request at all (the
    shortest, one prompt token and one generated, takes a block in every KV
    cache group), in one line with the numbers; return a warning when it
    holds no request of ``max_model_len`` tokens (``check_prompt`` refuses
    those at submission), else None. Both ask ``blocks_for``, as it does."""
    if capacity.num_rows is not None:  # contiguous: a row holds max_model_len
        return None
    blocks, null = capacity.num_blocks, capacity.num_tensor_blocks - capacity.num_blocks

    def need(length: int) -> int:  # a prompt of length - 1 tokens, and one generated
        return capacity.blocks_for(length - 1, length - 1)

    if need(2) > blocks:
        groups = capacity.num_groups
        where = f", one in each of the model's {groups} KV cache groups" if groups > 1 else ""
        kept = f" ({blocks + null} less the null block sliding windows keep)" if null else ""
        raise ValueError(
            f"KV cache: its {blocks} blocks{kept}, sized by {capacity.sized_by}, hold no request: "
            f"the shortest (one prompt token, one generated) needs {need(2)}{where}; raise "
            f"--num-gpu-blocks to at least {need(2) + null} (or --kv-cache-memory-bytes)"
        )
    if need(max_model_len) <= blocks:
        return None
    fits, over = 2, max_model_len  # the longest request that fits, by bisection
    while over - fits > 1:
        mid = (fits + over) // 2
        fits, over = (mid, over) if need(mid) <= blocks else (fits, mid)
    return (
        f"KV cache: its {blocks} blocks cannot hold every request max_model_len {max_model_len} "
        f"allows (a {max_model_len - 1}-token prompt needs {need(max_model_len)}); one that needs "
        f"more blocks than the cache has is refused when submitted (any of up to {fits} tokens, "
        f"prompt and max_tokens, fits): to accept every request, raise --num-gpu-blocks to "
        f"{need(max_model_len) + null} or lower --max-model-len to {fits}"
    )


def audit_engine(
    pool: KVCacheManagerProtocol, scheduler: Scheduler, capacity: PoolCapacity, idle: bool
) -> list[str]:
    """The pool's own audit, plus: every running sequence holds its own seq_id
    with the length the engine expects, no waiting sequence holds one, and
    an idle engine holds no KV capacity at all (else something leaked)."""
    problems = list(pool.audit())
    owners: dict[int, int] = {}
    for seq in scheduler.running:
        if seq.pool_seq_id is None:
            if not seq.is_finished:
                problems.append(f"running sequence {seq.seq_id} has no cache seq_id")
            continue
        if seq.pool_seq_id in owners:
            problems.append(
                f"seq_id {seq.pool_seq_id} is held by sequences {owners[seq.pool_seq_id]} and {seq.seq_id}"
            )
        owners[seq.pool_seq_id] = seq.seq_id
        if not seq.is_finished and pool.get_num_computed_tokens(seq.pool_seq_id) != seq.num_computed_tokens:
            problems.append(
                f"sequence {seq.seq_id}: pool holds {pool.get_num_computed_tokens(seq.pool_seq_id)} tokens, "
                f"engine expects {seq.num_computed_tokens}"
            )
    for seq in scheduler.waiting:
        if seq.pool_seq_id is not None:
            problems.append(f"waiting sequence {seq.seq_id} still holds seq_id {seq.pool_seq_id}")
    if idle:
        if capacity.num_rows is None:
            held = capacity.tokens - (pool.free_token_capacity() or 0)
            if held:
                problems.append(f"engine is idle but {held} KV tokens are still held (leak)")
        elif pool.free_seq_count() != capacity.num_rows:
            problems.append(
                f"engine is idle but {capacity.num_rows - pool.free_seq_count()} "
                "cache seq_ids are still held (leak)"
            )
    return problems
