"""Which adapter sits in which device slot: ``max_loras`` slots, the least
recently used adapter out first.

Pure bookkeeping, no tensors: ``LoRAManager`` writes the weights a slot
change asks for. Every rank of a tensor-parallel engine keeps its own table
and makes the same calls in the same order, so all agree on every slot (as
they agree on every KV block). A step may use at most ``max_loras``
adapters (the scheduler's limit, as in vLLM); an adapter a step uses is
never evicted by that step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class SlotTable:
    """``num_slots`` slots; ``assign`` puts a step's adapters in slots."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"max_loras must be at least 1, got {num_slots}")
        self.num_slots = num_slots
        self._slots: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    def slot_of(self, name: str) -> int:
        """``name``'s slot, or -1 when it is in none."""
        return self._slots.get(name, -1)

    @property
    def names(self) -> list[str]:
        """The adapters in slots, least recently used first."""
        return list(self._slots)

    def assign(self, names: Sequence[str]) -> list[tuple[int, str]]:
        """Make sure every adapter of ``names`` (one step's, in a fixed
        order) has a slot, most recently used now; return the ``(slot,
        name)`` pairs whose weights must be written. A slot is taken from
        the free ones first, then from the least recently used adapter that
        this step does not use."""
        wanted = list(dict.fromkeys(names))
        if len(wanted) > self.num_slots:
            raise ValueError(
                f"one step uses {len(wanted)} LoRA adapters but max_loras is {self.num_slots}; "
                "schedule at most max_loras adapters per step (or raise --max-loras)"
            )
        for name in wanted:
            if name in self._slots:
                self._slots.move_to_end(name)
        loads = []
        for name in wanted:
            if name in self._slots:
                continue
            if self._free:
                slot = self._free.pop()
            else:
                victim = next(n for n in self._slots if n not in wanted)
                slot = self._slots.pop(victim)
            self._slots[name] = slot
            loads.append((slot, name))
        return loads

    def free(self, name: str) -> int:
        """Take ``name`` out of its slot; the slot it held (-1: none)."""
        slot = self._slots.pop(name, -1)
        if slot >= 0:
            self._free.append(slot)
        return slot
