"""Draft model (vLLM's ``{"model": DIR, "num_speculative_tokens": k}``): a
smaller model with the target's tokenizer drafts ``k`` greedy tokens.

The proposer owns a second engine of this project's own stack over the
draft checkpoint: its worker (weights, compiled passes) and its paged KV
cache with prefix caching on. That engine's scheduler, sampler and outputs
are never used (at one stream of a small model they cost as much as its
forward pass): ``propose_all`` drives the draft's worker itself, since a
draft's passes are planned by construction. Each speculating sequence
keeps a draft seq_id from one step to the next (by the target's sequence
id), holding KV for its history and the drafts it fed back in; a call
cuts it back to what the target kept, computes the tokens since (usually
the bonus token) in one batched pass whose last rows' argmax are the first
drafts, then ``k - 1`` one-token passes, each feeding back the draft
before (``Worker.greedy``: layers, LM head and argmax in one compiled
graph). A new history, or one that has not drafted for a while, is first
caught up in passes of the token budget (prefix hits serve a shared
prompt); that backlog is timed apart (``backlog_seconds``) so the engine's
step timing counts what drafting every step costs. ``retain`` frees the
draft KV of sequences that stopped running; when the pool runs short,
sequences not drafting in the call give theirs up. Drafts are point
masses (the draft's argmax), so ``verify.py`` keeps every answer the
target's, greedy or sampled.

Memory: the draft's pool is sized to hold the target pool's tokens plus
``k`` drafts for every sequence (an explicit block count, logged at
start-up with its bytes). It is allocated after the target's pool: on CUDA
the draft's weights and KV come on top of the target's
``gpu_memory_utilization`` share (docs/serving.md).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from paged_server.config import EngineConfig, RunConfig
from paged_server.engine.kv.pool_factory import PoolCapacity
from paged_server.engine.worker.worker import WorkerStep
from paged_server.errors import ModelLoadError
from paged_server.models.config import ModelConfig
from paged_server.speculative_config import SpeculativeConfig
from paged_server.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# A CPU's default ``disable_by_batch_size`` for a draft model: it drafts only
# while one sequence runs. Its passes are host-bound there (~0.9 ms a token
# for the trained default's 2-layer draft against a ~1.9 ms target step),
# so at one stream it pays (1.15-1.18x, benchmarks/spec_decode.py) but
# beside others a drafting sequence races ahead while the rest wait on its
# passes: 32 streams drafting where the step times said it paid ran at
# 0.62-0.66x of no speculation. ``disable_by_batch_size`` set says otherwise.
CPU_DISABLE_BY_BATCH_SIZE = 2


def with_cpu_default(spec: SpeculativeConfig, device_type: str) -> SpeculativeConfig:
    """``spec`` with ``CPU_DISABLE_BY_BATCH_SIZE`` for a draft model on a
    CPU whose ``disable_by_batch_size`` is unset; else ``spec``."""
    if spec.method != "draft_model" or device_type != "cpu" or spec.disable_by_batch_size is not None:
        return spec
    log.info(
        "draft model on a CPU: drafting while fewer than %d sequences run (disable_by_batch_size; "
        "set it in speculative_config to change this)", CPU_DISABLE_BY_BATCH_SIZE,
    )  # fmt: skip
    return dataclasses.replace(spec, disable_by_batch_size=CPU_DISABLE_BY_BATCH_SIZE)


class Engine(Protocol):
    """What this proposer reads of the target engine, and runs of its own
    (``LLMEngine``'s, named here so the engine that imports this need not be)."""

    config: RunConfig
    capacity: PoolCapacity
    tokenizer: Tokenizer
    model_config: ModelConfig
    eos_token_ids: frozenset[int]
    kv_manager: Any  # the draft's: its page tables (allocate, reserve, step_layout, free)
    executor: Any  # the draft's: its worker's ``greedy(WorkerStep)`` through ``collective_rpc``

    def shutdown(self) -> None: ...


@dataclass(slots=True)
class _DraftSeq:
    """A target sequence's draft KV: its draft seq_id, the tokens its KV was
    written for (the history, then the drafts fed back in), how many of them
    are the history (committed), how many have KV this call keeps."""

    seq_id: int
    tokens: list[int]
    history: int
    computed: int


class DraftModelProposer:
    """Greedy drafts from a second engine over the draft model."""

    def __init__(self, spec: SpeculativeConfig, target: Engine) -> None:
        assert spec.model is not None
        self.k = spec.num_speculative_tokens
        run, capacity = target.config, target.capacity
        block = run.block_size
        blocks_per_draft = -(-(self.k + 1) // block)  # a history's partial block and its drafts
        num_blocks = -(-capacity.tokens // block) + run.max_batch_size * blocks_per_draft + 1
        draft_len = spec.max_model_len or run.max_model_len
        config = EngineConfig(
            model=spec.model, quantization=spec.quantization, device=run.device,
            attention_backend=run.attention_backend, enforce_eager=run.enforce_eager,
            block_size=block, num_gpu_blocks=num_blocks, max_batch_size=run.max_batch_size,
            max_model_len=draft_len, max_num_batched_tokens=run.max_num_batched_tokens,
            enable_prefix_caching=True, generation_config="vllm", seed=run.seed,
        )  # fmt: skip
        # The target's class, so this module need not import the engine that imports it.
        try:
            self.engine: Engine = type(target)(config)  # type: ignore[call-arg]
        except (ValueError, ModelLoadError) as exc:  # say whose setting or files: the draft's
            why = str(exc)
            if "max_model_len" in why and spec.max_model_len is None:
                why += ' (the target\'s; set the draft\'s with "max_model_len")'
            raise type(exc)(f"speculative_config: draft model {spec.model}: {why}") from exc
        try:
            check_same_vocabulary(target, self.engine, spec.model)
            self.engine.executor.collective_rpc("warm_up_greedy", self.k - 1)  # the passes' own graphs
        except BaseException:
            self.engine.shutdown()
            raise
        self.max_model_len = self.engine.config.max_model_len
        self._seqs: dict[int, _DraftSeq] = {}  # by the target's sequence id
        self.backlog_seconds = 0.0  # the last call's backlog passes (``_draft``)
        draft_capacity = self.engine.capacity
        log.info(
            "draft model %s: KV cache %d tokens (%d blocks of %d, %.3f GiB), sized to the target's "
            "%d tokens plus %d drafts per sequence",
            spec.model, draft_capacity.tokens, draft_capacity.num_blocks, block,
            draft_capacity.kv_bytes / 2**30, capacity.tokens, self.k,
        )  # fmt: skip

    def propose_all(
        self, keys: Sequence[int], histories: Sequence[Sequence[int]], limits: Sequence[int]
    ) -> list[list[int]]:
        """One greedy draft per history (at most ``limits[i]`` and ``k``
        tokens), all run as one batch on the draft's worker (module doc).
        ``keys``: the target's sequence ids, under which each sequence's
        draft KV is kept from one call to the next."""
        wanted = [
            max(0, min(limit, self.k, self.max_model_len - len(history)))
            for history, limit in zip(histories, limits, strict=True)
        ]
        drafts: list[list[int]] = [[] for _ in histories]
        self.backlog_seconds = 0.0
        going: list[tuple[int, _DraftSeq]] = []  # (history index, its draft sequence)
        try:
            for i, (key, history, n) in enumerate(zip(keys, histories, wanted, strict=True)):
                if n and (seq := self._make_room(key, history, n, keys)) is not None:
                    going.append((i, seq))
            self._draft(histories, wanted, going, drafts)
        except Exception:  # a failed draft is no draft: the target decodes as usual
            log.exception("draft model pass failed; these sequences decode without drafts")
            for key in keys:
                self._forget(key)
            return [[] for _ in histories]
        kv = self.engine.kv_manager
        for i, seq in going:  # what the next call may reuse: the history, and the drafts fed back in
            seq.tokens, seq.history = list(histories[i]) + drafts[i][:-1], len(histories[i])
            kv.mark_computed(seq.seq_id, seq.history)
        return drafts

    def retain(self, keys: Sequence[int]) -> None:
        """Free the draft KV of every target sequence but ``keys`` (the
        running ones: the rest ended, or were preempted and will catch up)."""
        for key in set(self._seqs).difference(keys):
            self._forget(key)

    def _make_room(self, key: int, history: Sequence[int], n: int, busy: Sequence[int]) -> _DraftSeq | None:
        """``key``'s draft sequence with room for ``history`` and the first
        ``n - 1`` drafts (fed back in; the last is only read out), its KV
        kept as far as it matches ``history``; None where the draft pool
        is short even after freeing the sequences not drafting now."""
        kv = self.engine.kv_manager
        upto = len(history) + n - 1
        seq = self._seqs.get(key)
        if seq is not None:  # the history since: the bonus token, the kept drafts
            same = seq.history
            while same < len(seq.tokens) and same < len(history) and seq.tokens[same] == history[same]:
                same += 1
            kv.truncate(seq.seq_id, same)
            seq.computed = same
        for attempt in range(2):
            if seq is None and kv.can_allocate_sequence(history, num_reserved=upto):
                seq_id, cached = kv.allocate_sequence(history)
                seq = self._seqs[key] = _DraftSeq(seq_id, [], 0, cached)
            if seq is not None and kv.reserve(seq.seq_id, history, upto) == upto:
                return seq
            if attempt == 0:  # short of blocks: free what is not drafting in this call
                idle = set(self._seqs) - set(busy)
                for other in idle:
                    self._forget(other)
        self._forget(key)
        return None

    def _forget(self, key: int) -> None:
        seq = self._seqs.pop(key, None)
        if seq is not None:
            self.engine.kv_manager.free_seq(seq.seq_id)

    def _draft(
        self, histories: Sequence[Sequence[int]], wanted: list[int], going: list[tuple[int, _DraftSeq]],
        drafts: list[list[int]],
    ) -> None:  # fmt: skip
        """The passes: first the backlog (a history's tokens past its kept KV
        but its last ``k + 1``, what drafting every step leaves: a new
        history, or one that has not drafted for a while), timed apart as
        ``backlog_seconds``; then the rest, whose last row gives draft 1;
        then one token per sequence and pass, each pass's argmax the next
        input. The catch-up passes take chunks of the token budget."""
        kv, rpc = self.engine.kv_manager, self.engine.executor.collective_rpc
        start = time.perf_counter()
        steady = [max(seq.computed, len(histories[i]) - self.k - 1) for i, seq in going]
        pairs = list(zip(going, steady, strict=True))
        self._catch_up(histories, [(i, seq.seq_id, seq.computed, end) for (i, seq), end in pairs])
        self.backlog_seconds = time.perf_counter() - start
        last = [(i, seq.seq_id, end, len(histories[i])) for (i, seq), end in pairs]
        for i, token in self._catch_up(histories, last):
            drafts[i].append(token)
        live = {i: seq.seq_id for i, seq in going}
        if {wanted[i] for i in live} == {self.k}:  # k drafts each: the passes in one (warm) graph
            self._passes(histories, live, drafts)
            return
        for step in range(1, max(wanted, default=0)):
            now = [i for i in live if wanted[i] > step]
            if not now:
                break
            for i in now:
                kv.set_token(live[i], len(histories[i]) + step - 1, drafts[i][-1])
            layout = kv.step_layout(
                [live[i] for i in now], [len(histories[i]) + step - 1 for i in now], [1] * len(now)
            )
            step_ids = [drafts[i][-1] for i in now]
            tokens = rpc("greedy", WorkerStep(step_ids, layout, list(range(len(now))), every_row=True))
            for i, token in zip(now, tokens, strict=True):
                drafts[i].append(token)

    def _passes(
        self, histories: Sequence[Sequence[int]], live: dict[int, int], drafts: list[list[int]]
    ) -> None:
        """Drafts 2..k of sequences that all want ``k``: the ``k - 1``
        one-token passes in one ``Worker.greedy_passes`` call (one compiled
        graph for up to 8 sequences, warmed up for ``k - 1`` passes), every
        pass's layout made first."""
        kv, rpc = self.engine.kv_manager, self.engine.executor.collective_rpc
        order, passes = list(live), self.k - 1
        if passes < 1:
            return
        seq_ids = [live[i] for i in order]
        layouts = [
            kv.step_layout(seq_ids, [len(histories[i]) + step for i in order], [1] * len(order))
            for step in range(passes)
        ]
        tokens = rpc("greedy_passes", [drafts[i][-1] for i in order], layouts)
        for i, more in zip(order, tokens, strict=True):
            drafts[i] += more
            for step, token in enumerate(drafts[i][:-1]):  # the ids the KV was written for
                kv.set_token(live[i], len(histories[i]) + step, token)

    def _catch_up(
        self, histories: Sequence[Sequence[int]], spans: list[tuple[int, int, int, int]]
    ) -> list[tuple[int, int]]:
        """Compute ``histories[i][start:end]`` for each ``(i, seq_id, start,
        end)``, in passes of at most the token budget; returns ``(i, argmax
        of its last row)`` for each span that ends its history."""
        kv, rpc = self.engine.kv_manager, self.engine.executor.collective_rpc
        budget = self.engine.config.max_num_batched_tokens
        out: list[tuple[int, int]] = []
        todo = [span for span in spans if span[2] < span[3]]
        while todo:
            seq_ids, starts, lens, ids, rows, ends, rest = [], [], [], [], [], [], []
            room = budget
            for i, seq_id, start, end in todo:
                take = min(end - start, room)
                if take <= 0:
                    rest.append((i, seq_id, start, end))
                    continue
                seq_ids.append(seq_id)
                starts.append(start)
                lens.append(take)
                ids += histories[i][start : start + take]
                room -= take
                if start + take < end:
                    rest.append((i, seq_id, start + take, end))
                elif end == len(histories[i]):
                    rows.append(len(ids) - 1)
                    ends.append(i)
            tokens = rpc("greedy", WorkerStep(ids, kv.step_layout(seq_ids, starts, lens), rows))
            out += zip(ends, tokens, strict=True)
            todo = rest
        return out

    def shutdown(self) -> None:
        """Stop the draft engine."""
        self.engine.shutdown()


def check_same_vocabulary(target: Engine, draft: Engine, draft_name: str) -> None:
    """Refuse a draft whose token ids mean something else: vocabulary size,
    tokenizer vocabulary and EOS ids must equal the target's."""
    target_name = target.config.model or "the target model"
    problem = None
    if draft.model_config.vocab_size != target.model_config.vocab_size:
        problem = f"vocab_size {draft.model_config.vocab_size} against {target.model_config.vocab_size}"
    elif draft.tokenizer.hf.get_vocab(with_added_tokens=True) != target.tokenizer.hf.get_vocab(
        with_added_tokens=True
    ):
        problem = "a different tokenizer vocabulary (tokenizer.json)"
    elif draft.eos_token_ids != target.eos_token_ids:
        problem = f"EOS ids {sorted(draft.eos_token_ids)} against {sorted(target.eos_token_ids)}"
    if problem is not None:
        raise ValueError(
            f"speculative_config: draft model {draft_name} does not share the tokenizer of "
            f"{target_name}: {problem}; a draft model needs the target's tokenizer"
        )

