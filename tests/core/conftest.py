"""Shared helpers for the block-manager tests.

``FakePool`` plays the KV pool around a ``BlockManager``: it "writes" each
token id into the block its page table gives (in every KV cache group),
copies blocks when ``append`` asks for copy-on-write, and checks that every
sequence reads back exactly its own tokens: all of them in a full-attention
group, the last ``window`` in a sliding one. That turns block-table bugs (a
hit on wrong or unwritten KV, a write into a shared block, a block freed
while still in the window) into visible wrong "KV".
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from paged_core import BlockManager


class FakePool:
    """A block manager plus per-block token "KV" and each sequence's true tokens."""

    def __init__(self, manager: BlockManager) -> None:
        self.m = manager
        bs = manager.block_size
        # + 1: the null block (hybrid), never written, so reading it reads wrong KV
        self.kv: list[list[int | None]] = [[None] * bs for _ in range(manager.num_blocks + 1)]
        self.tokens: dict[int, list[int]] = {}

    def allocate(self, seq_id: int, tokens: Sequence[int]) -> int:
        """Admit a prompt; checks that every hit block already holds its tokens."""
        cached = self.m.allocate(seq_id, list(tokens))
        self.tokens[seq_id] = list(tokens)
        assert cached % self.m.block_size == 0 and 0 <= cached < len(tokens)
        self.check_reads(seq_id, upto=cached)
        return cached

    def compute(self, seq_id: int, upto: int | None = None) -> None:
        """Write the KV of positions [computed, upto) and tell the manager."""
        end = self.m.num_tokens(seq_id) if upto is None else upto
        bs = self.m.block_size
        for g in range(self.m.num_groups):
            table = self.m.block_table(seq_id, g)
            for pos in range(self.m.num_computed_tokens(seq_id), end):
                block, off = table[pos // bs], pos % bs
                token = self.tokens[seq_id][pos]
                # a block shared with another sequence may only be written with a token
                # every sharer agrees on (one shared prefix); anything else is a missed CoW
                if self.m.block_pool.blocks[block].ref_count > 1:
                    for other, toks in self.tokens.items():
                        shared = block in self.m.block_table(other, g)
                        if other != seq_id and pos < len(toks) and shared:
                            assert toks[pos] == token, (
                                f"sequence {seq_id} writes into block {block} shared with {other}"
                            )
                self.kv[block][off] = token
        self.m.mark_computed(seq_id, end)

    def append(self, seq_id: int, token: int) -> list[tuple[int, int]]:
        copies = [(src, dst) for _, src, dst in self.m.append(seq_id, token)]
        for src, dst in copies:
            self.kv[dst] = list(self.kv[src])
        self.tokens[seq_id].append(token)
        return copies

    def fork(self, parent: int, child: int) -> None:
        self.m.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    def free(self, seq_id: int) -> None:
        self.m.free(seq_id)
        del self.tokens[seq_id]

    def preempt(self, seq_id: int) -> int:
        """What the engine's preemption does: free, keeping the count to recompute."""
        n = self.m.num_tokens(seq_id)
        assert n == len(self.tokens[seq_id])
        self.free(seq_id)
        return n

    def check_reads(self, seq_id: int, upto: int | None = None) -> None:
        """Every computed position of ``seq_id`` the next query can see reads
        back its own token, in every group."""
        end = self.m.num_computed_tokens(seq_id) if upto is None else upto
        bs = self.m.block_size
        for g, window in enumerate(self.m.windows):
            table = self.m.block_table(seq_id, g)
            start = 0 if window is None else max(0, end - window + 1)
            got = [self.kv[table[p // bs]][p % bs] for p in range(start, end)]
            want = self.tokens[seq_id][start:end]
            assert got == want, f"sequence {seq_id} reads wrong KV in group {g}"

    def check_all(self) -> None:
        assert self.m.audit() == []
        assert sorted(self.m.seq_ids()) == sorted(self.tokens)
        for seq_id in self.tokens:
            assert self.m.num_tokens(seq_id) == len(self.tokens[seq_id])
            self.check_reads(seq_id)


@pytest.fixture(scope="session")
def fake_pool():
    """Factory: ``fake_pool(num_blocks, block_size, enable_prefix_caching=True,
    sliding_windows=(None,))``."""

    def make(
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_windows: Sequence[int | None] = (None,),
    ) -> FakePool:
        manager = BlockManager(
            num_blocks, block_size, enable_prefix_caching, sliding_windows=sliding_windows
        )
        return FakePool(manager)

    return make
