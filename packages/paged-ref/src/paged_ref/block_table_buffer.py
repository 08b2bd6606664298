"""Page tables as rows of one host tensor, kept in step with the block manager.

The block manager's tables are Python lists; turning every running
sequence's list into a tensor each step costs time proportional to all
blocks held. This buffer keeps one int32 row per live sequence and is
updated only where a table changes (blocks added, a copy-on-write block
swapped in, a fork, a free), so building a step's ``block_tables`` is one
gather of the rows in the batch. The rows live in a numpy array (``table``
is a tensor view of it): writing one entry costs ~0.1 us there against
~4 us through torch's indexing, and a step writes one per sequence that
crossed a block boundary.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class BlockTableBuffer:
    """``[rows, width]`` int32 page tables addressed by sequence handle;
    grows (doubling) when more sequences or longer tables arrive."""

    def __init__(self, rows: int = 16, width: int = 16) -> None:
        self._array = np.zeros((max(rows, 1), max(width, 1)), dtype=np.int32)
        self.table = torch.from_numpy(self._array)  # shares the array's memory
        self._row_of: dict[int, int] = {}
        self._lens: list[int] = [0] * self.table.shape[0]
        self._free_rows = list(range(self.table.shape[0] - 1, -1, -1))

    def __contains__(self, handle: int) -> bool:
        return handle in self._row_of

    def add(self, handle: int, blocks: Sequence[int]) -> None:
        """A row for a new sequence holding ``blocks``."""
        if handle in self._row_of:
            raise ValueError(f"sequence {handle} already has a page-table row")
        if not self._free_rows:
            self._grow(rows=2 * self.table.shape[0])
        row = self._free_rows.pop()
        self._row_of[handle] = row
        self._lens[row] = 0
        self.extend(handle, blocks)

    def extend(self, handle: int, blocks: Sequence[int]) -> None:
        """Append ``blocks`` to the sequence's table."""
        if not blocks:
            return
        row = self._row_of[handle]
        n = self._lens[row]
        end = n + len(blocks)
        if end > self.table.shape[1]:
            self._grow(width=max(end, 2 * self.table.shape[1]))
        self._array[row, n:end] = blocks
        self._lens[row] = end

    def set(self, handle: int, index: int, block: int) -> None:
        """Replace entry ``index`` (a copy-on-write block taking a shared one's place)."""
        row = self._row_of[handle]
        if not 0 <= index < self._lens[row]:
            raise IndexError(f"sequence {handle} has {self._lens[row]} blocks, no index {index}")
        self._array[row, index] = block

    def fork(self, parent: int, child: int) -> None:
        """A row for ``child`` with ``parent``'s blocks."""
        self.add(child, [])
        src, dst = self._row_of[parent], self._row_of[child]
        n = self._lens[src]
        self._array[dst, :n] = self._array[src, :n]
        self._lens[dst] = n

    def truncate(self, handle: int, num_blocks: int) -> None:
        """Keep the sequence's first ``num_blocks`` entries."""
        row = self._row_of[handle]
        self._lens[row] = min(self._lens[row], num_blocks)

    def remove(self, handle: int) -> None:
        """Give the sequence's row back (its contents are left as they are)."""
        row = self._row_of.pop(handle)
        self._free_rows.append(row)

    def num_blocks(self, handle: int) -> int:
        return self._lens[self._row_of[handle]]

    def last(self, handle: int) -> int:
        """The sequence's last block id."""
        row = self._row_of[handle]
        return int(self._array[row, self._lens[row] - 1])

    def blocks(self, handle: int) -> list[int]:
        """The sequence's table as a list (audits and tests)."""
        row = self._row_of[handle]
        return self._array[row, : self._lens[row]].tolist()  # type: ignore[no-any-return]

    def handles(self) -> list[int]:
        return list(self._row_of)

    def rows(self, handles: Sequence[int]) -> list[int]:
        """Row index of each sequence (``KeyError`` for one without a row)."""
        return list(map(self._row_of.__getitem__, handles))

    def gather(self, rows: Sequence[int], width: int) -> np.ndarray:
        """``[len(rows), width]`` tables of these rows (entries past a table's
        end are stale: callers read only the blocks their tokens use)."""
        if width > self.table.shape[1]:
            self._grow(width=width)
        return self._array[rows, :width]  # fancy indexing: a copy

    def _grow(self, rows: int | None = None, width: int | None = None) -> None:
        old_rows, old_width = self.table.shape
        new = np.zeros((rows or old_rows, width or old_width), dtype=np.int32)
        new[:old_rows, :old_width] = self._array
        self._array, self.table = new, torch.from_numpy(new)
        if rows:
            self._lens += [0] * (rows - old_rows)
            self._free_rows = list(range(rows - 1, old_rows - 1, -1)) + self._free_rows
