"""What the block manager keeps per sequence, and the error for an unknown one."""

from __future__ import annotations

from dataclasses import dataclass, field

from paged_core.prefix_cache import BlockHash


class UnknownSequenceError(ValueError, KeyError):
    """A sequence id the block manager does not hold (never allocated, or
    already freed). Both a ``ValueError`` and a ``KeyError``."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass(slots=True)
class SequenceBlocks:
    """One sequence's page table and what prefix caching needs to know of it."""

    table: list[int]
    num_tokens: int  # reserved: prompt + appended
    num_computed: int = 0  # tokens whose KV the pool reported written
    tokens: list[int] = field(default_factory=list)  # leading known token ids
    tokens_complete: bool = True  # False once a token id was not given
    hashes: list[BlockHash] = field(default_factory=list)  # chained keys of leading full blocks

    def copy(self) -> SequenceBlocks:
        """An independent copy (for forks)."""
        return SequenceBlocks(
            table=list(self.table),
            num_tokens=self.num_tokens,
            num_computed=self.num_computed,
            tokens=list(self.tokens),
            tokens_complete=self.tokens_complete,
            hashes=list(self.hashes),
        )
