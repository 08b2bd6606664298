"""Prefix-cache index: which physical block holds the KV of which token prefix.

Block ``i`` of a sequence covers tokens ``0 .. (i+1)*block_size``; its key is a
chained hash, ``H(key of block i-1, tokens of block i)``, so equal keys mean the
whole prefix matches, not only the block's own tokens. The hash is blake2b
over bytes (stable across processes, unlike Python's ``hash()``), and a hit
also compares the stored tokens, so a collision can never serve wrong KV.

The index knows content only. Which blocks are free, and in which order
cached ones are evicted, is the block manager's business.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes


def hash_block_tokens(parent: BlockHash | None, tokens: Sequence[int]) -> BlockHash:
    """Chained key of one full block: its parent's key (``None`` for the first
    block) followed by the block's token ids as signed 64-bit integers.

    The first block hashes ``block_size * 8`` bytes and later ones 16 more,
    so a root key can never equal a child key by concatenation."""
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class PrefixCache:
    """Maps block keys to block ids and remembers each cached block's tokens.

    A key maps to at most one block and a block holds at most one key. When
    two sequences compute the same content into different blocks, the first
    registration wins and the second block stays uncached."""

    def __init__(self) -> None:
        self._block_by_hash: dict[BlockHash, int] = {}
        self._hash_by_block: dict[int, BlockHash] = {}
        self._tokens_by_block: dict[int, tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self._block_by_hash)

    def lookup(self, block_hash: BlockHash, tokens: Sequence[int]) -> int | None:
        """The block holding ``tokens`` under ``block_hash``, or ``None``."""
        block_id = self._block_by_hash.get(block_hash)
        if block_id is None or self._tokens_by_block[block_id] != tuple(tokens):
            return None
        return block_id

    def register(self, block_id: int, block_hash: BlockHash, tokens: Sequence[int]) -> bool:
        """Record that ``block_id``'s KV (now computed) holds ``tokens`` under
        ``block_hash``. Returns whether the block became cached."""
        if block_hash in self._block_by_hash or block_id in self._hash_by_block:
            return False
        self._block_by_hash[block_hash] = block_id
        self._hash_by_block[block_id] = block_hash
        self._tokens_by_block[block_id] = tuple(tokens)
        return True

    def is_cached(self, block_id: int) -> bool:
        """Whether ``block_id`` holds registered content."""
        return block_id in self._hash_by_block

    def hash_of(self, block_id: int) -> BlockHash | None:
        """The key ``block_id`` is registered under, if any."""
        return self._hash_by_block.get(block_id)

    def evict(self, block_id: int) -> bool:
        """Forget ``block_id``'s content (it is about to be overwritten).
        Returns whether it was cached."""
        block_hash = self._hash_by_block.pop(block_id, None)
        if block_hash is None:
            return False
        del self._block_by_hash[block_hash]
        del self._tokens_by_block[block_id]
        return True

    def cached_blocks(self) -> list[int]:
        """Every block id holding registered content, ascending."""
        return sorted(self._hash_by_block)

    def audit(self, num_blocks: int, block_size: int) -> list[str]:
        """Inconsistencies between the three maps (empty when healthy)."""
        problems = []
        for block_hash, block_id in self._block_by_hash.items():
            if self._hash_by_block.get(block_id) != block_hash:
                problems.append(
                    f"prefix index maps a key to block {block_id}, which is not registered under it"
                )
        for block_id in self._hash_by_block:
            if not 0 <= block_id < num_blocks:
                problems.append(f"prefix index holds unknown block id {block_id}")
            tokens = self._tokens_by_block.get(block_id)
            if tokens is None or len(tokens) != block_size:
                problems.append(
                    f"cached block {block_id} does not store exactly {block_size} tokens"
                )
        if len(self._hash_by_block) != len(self._block_by_hash):
            problems.append(
                f"prefix index has {len(self._block_by_hash)} keys but {len(self._hash_by_block)} cached blocks"
            )
        return problems
