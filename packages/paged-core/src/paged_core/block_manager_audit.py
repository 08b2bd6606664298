"""Consistency audit of a ``BlockManager``: every way its structures can disagree.

Kept apart from the manager so the hot paths stay short; it reads the
manager's internals on purpose, since that is what it checks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paged_core.block_manager import BlockManager


def audit_block_manager(manager: BlockManager) -> list[str]:
    """Every inconsistency between the allocator's ref counts and owners, the
    page tables, the free lists and the prefix index (empty when healthy).

    The free list is checked against the ref counts in both directions: a
    referenced block on it would be handed out twice, an unreferenced block
    off it (and off the plain list) is lost for good."""
    problems: list[str] = []
    alloc = manager.allocator
    cache = manager.block_pool.cache
    free_list = set(alloc.free_blocks())
    plain_list = set(manager.block_pool.plain_free_blocks())
    valid = range(manager.num_blocks)
    for name, ids in (("free list", free_list), ("plain free list", plain_list)):
        problems.extend(f"{name} holds unknown block id {b}" for b in sorted(ids - set(valid)))
    bs = manager.block_size
    holders: dict[int, set[int]] = {}
    tokens_used = 0

    for seq_id, seq in manager._seqs.items():
        tokens_used += seq.num_tokens
        where = f"sequence {seq_id}"
        if seq.num_tokens < 1:
            problems.append(f"{where} has {seq.num_tokens} tokens")
        if len(seq.table) != -(-seq.num_tokens // bs):
            problems.append(f"{where} has {seq.num_tokens} tokens but {len(seq.table)} blocks")
        if not 0 <= seq.num_computed <= seq.num_tokens:
            problems.append(f"{where} has {seq.num_computed} computed of {seq.num_tokens} tokens")
        if len(set(seq.table)) != len(seq.table):
            problems.append(f"{where} holds a block twice: {seq.table}")
        if len(seq.hashes) > seq.num_tokens // bs:
            problems.append(
                f"{where} has {len(seq.hashes)} block keys for {seq.num_tokens // bs} full blocks"
            )
        if (
            manager.enable_prefix_caching
            and seq.tokens_complete
            and len(seq.tokens) != seq.num_tokens
        ):
            problems.append(
                f"{where} recorded {len(seq.tokens)} token ids for {seq.num_tokens} tokens"
            )
        for i, block_id in enumerate(seq.table):
            if not 0 <= block_id < manager.num_blocks:
                problems.append(f"{where} points at unknown block id {block_id}")
                continue
            holders.setdefault(block_id, set()).add(seq_id)
            key = cache.hash_of(block_id)
            if key is None:
                continue
            if i < len(seq.hashes) and seq.hashes[i] != key:
                problems.append(
                    f"{where}: cached block {block_id} at index {i} has another prefix key"
                )
            own = seq.tokens[i * bs : (i + 1) * bs]
            if len(own) == bs and cache.lookup(key, own) != block_id:
                problems.append(
                    f"{where}: cached block {block_id} at index {i} stores other tokens"
                )

    for block_id in valid:
        seqs = holders.get(block_id, set())
        refs = alloc.ref_count(block_id)
        if refs != len(seqs):
            kind = "leaked" if not seqs else "miscounted"
            problems.append(
                f"block {block_id} ({kind}) has ref count {refs} but {len(seqs)} page tables hold it"
            )
        if alloc.owners(block_id) != seqs:
            problems.append(
                f"block {block_id} is owned by {set(alloc.owners(block_id))} "
                f"but held by {sorted(seqs)}"
            )
        if refs and block_id in free_list:
            problems.append(
                f"block {block_id} has ref count {refs} but is on the free list "
                "(it can be handed out while in use)"
            )
        elif not refs and block_id not in free_list:
            problems.append(
                f"block {block_id} has ref count 0 but is on no free list "
                "(lost: it can never be handed out)"
            )
        plain = block_id in plain_list
        if block_id in free_list:
            if plain == cache.is_cached(block_id):
                state = "both plain and cached" if plain else "neither plain nor cached"
                problems.append(f"free block {block_id} is {state}")
        elif plain:
            problems.append(f"block {block_id} is off the free list but listed as plain free")

    if tokens_used != manager._tokens_used:
        problems.append(
            f"tokens_used counter is {manager._tokens_used}, page tables hold {tokens_used}"
        )
    if not manager.enable_prefix_caching and len(cache):
        problems.append(f"prefix caching is off but {len(cache)} blocks are cached")
    problems.extend(cache.audit(manager.num_blocks, bs))
    return problems
