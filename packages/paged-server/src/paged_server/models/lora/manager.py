"""One rank's LoRA adapters: registered by name, kept read in host memory
(LRU over ``max_cpu_loras``), written into ``max_loras`` device slots (LRU,
``slots.py``) as steps need them, and each step's ``LoRAMapping``.

The engine's side of it, per step (vLLM's worker does the same)::

    manager = LoRAManager(model, LoRAConfig(max_loras=4, max_lora_rank=16))
    manager.add("sql", "/adapters/sql")        # read + checked now: errors at load time
    mapping = manager.mapping(new_lens, names)  # names[i]: sequence i's adapter or None
    logits = model(ids, positions, view, lora=mapping)   # None: the base model, no cost
    manager.remove("sql")

``mapping`` puts the step's adapters in slots first (writing the ones that
are not there, evicting the least recently used others) and returns None
when no row uses an adapter, so a step without adapters runs the model's
forward unchanged. A step may name at most ``max_loras`` adapters. With
tensor parallelism every rank holds a manager over its shard and gets the
same calls in the same order, so the slots agree everywhere.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from paged_ref.lora_ops import LoRAMapping
from paged_server.models.base import CausalLM
from paged_server.models.errors import LoRAAdapterError
from paged_server.models.lora.adapter import LoRAAdapter, read_adapter
from paged_server.models.lora.layers import LoRAWeights, Source, attach, projection_sources
from paged_server.models.lora.slots import SlotTable
from paged_server.models.registry import ARCHITECTURES

# What one adapter becomes on this rank: per projection table, the factors it writes.
Factors = dict[str, list[tuple[Source, Tensor, Tensor]]]


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """vLLM's LoRA limits: ``max_loras`` adapters in one step (the device
    slots), ``max_lora_rank`` (each slot's padded rank: an adapter of a
    higher rank is refused), ``max_cpu_loras`` adapters kept read in host
    memory (default ``max_loras``; others are read again from disk)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )

    @property
    def cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


class LoRAManager:
    """The adapters of ``model`` (this rank's shard), applied with ``ops``
    (``paged_ref.lora_ops`` by default, ``paged_triton.lora_ops`` on CUDA)."""

    def __init__(self, model: CausalLM, config: LoRAConfig, ops: ModuleType | None = None) -> None:
        self.model, self.config = model, config
        self.tables: dict[str, LoRAWeights] = attach(
            model, config.max_loras, config.max_lora_rank, ops
        )
        self.slots = SlotTable(config.max_loras)
        self._paths: dict[str, Path] = {}
        self._host: OrderedDict[str, Factors] = OrderedDict()  # least recently used first
        self._targets: dict[str, list[tuple[str, Source]]] = {}  # checkpoint module -> tables
        for table_name, (_, sources) in projection_sources(model).items():
            for src in sources:
                self._targets.setdefault(src.module, []).append((table_name, src))
        arch = ARCHITECTURES.get(model.config.architecture)
        self._rename = arch.weight_name if arch else (lambda name: name)
        first = next(iter(self.tables.values()), None)
        self.device = first.lora_a.device if first else torch.device("cpu")

    @property
    def names(self) -> list[str]:
        """Every adapter added, in the order added."""
        return list(self._paths)

    def add(self, name: str, path: str | Path) -> LoRAAdapter:
        """Read the adapter at ``path`` as ``name`` and check it against the
        model (modules, shapes, rank): an adapter that cannot be served is
        refused here, never at a step. It is not in a slot until a step uses it."""
        if name in self._paths:
            raise LoRAAdapterError(
                f"a LoRA adapter named {name!r} is already loaded (from {self._paths[name]}); "
                "unload it first or choose another name"
            )
        adapter = read_adapter(name, path)
        factors = self._factors(adapter)
        self._paths[name] = adapter.path
        self._keep(name, factors)
        return adapter

    def check(self, name: str, path: str | Path) -> LoRAAdapter:
        """``add``'s reading and checks without adding: what ``add`` would
        raise for it (the name aside). Touches no table or host copy."""
        adapter = read_adapter(name, path)
        self._factors(adapter)
        return adapter

    def remove(self, name: str) -> None:
        """Forget ``name``: its slot (zeroed) and host copy are freed."""
        if name not in self._paths:
            raise LoRAAdapterError(f"no LoRA adapter named {name!r} is loaded")
        slot = self.slots.free(name)
        if slot >= 0:
            for table in self.tables.values():
                table.clear(slot)
        del self._paths[name]
        self._host.pop(name, None)

    def slot_of(self, name: str) -> int:
        """``name``'s device slot, -1 when it is in none."""
        return self.slots.slot_of(name)

    def activate(self, names: Sequence[str]) -> list[int]:
        """Put the adapters ``names`` (one step's, at most ``max_loras``
        distinct) in slots, writing those not there yet; their slots."""
        unknown = [n for n in names if n not in self._paths]
        if unknown:
            raise LoRAAdapterError(f"no LoRA adapter named {unknown[0]!r} is loaded")
        for slot, name in self.slots.assign(names):
            factors = self._factors_of(name)
            for table_name, table in self.tables.items():
                table.write(slot, factors.get(table_name, []))
        return [self.slots.slot_of(n) for n in names]

    def mapping(
        self, lens: Sequence[int], names: Sequence[str | None], rows: int | None = None
    ) -> LoRAMapping | None:
        """The step's ``LoRAMapping`` for sequences of ``lens`` new tokens
        each, in flat-batch order, served by ``names`` (None: the base
        model); None when no sequence uses an adapter. ``rows``: the
        batch's padded row count."""
        used = [n for n in names if n is not None]
        if not used:
            return None
        self.activate(used)
        slots = [-1 if n is None else self.slots.slot_of(n) for n in names]
        return LoRAMapping.build(lens, slots, self.device, rows)

    def _factors_of(self, name: str) -> Factors:
        factors = self._host.get(name)
        if factors is None:  # evicted from host memory: read it again
            factors = self._factors(read_adapter(name, self._paths[name]))
        self._keep(name, factors)
        return factors

    def _keep(self, name: str, factors: Factors) -> None:
        self._host[name] = factors
        self._host.move_to_end(name)
        while len(self._host) > self.config.cpu_loras:
            self._host.popitem(last=False)

    def _factors(self, adapter: LoRAAdapter) -> Factors:
        """Where each of ``adapter``'s factors goes on this rank, checked:
        every module it adapts must be a projection of this model (another
        pipeline stage's layers are skipped) with the adapter's shapes."""
        where = f"LoRA adapter {adapter.name!r}"
        adaptable = sorted({m.rpartition(".")[2] for m in self._targets})
        targets = adapter.config.target_modules
        if isinstance(targets, tuple):
            missing = [
                t for t in targets
                if not any(m == t or m.endswith("." + t) for m in self._targets)
            ]  # fmt: skip
            if missing:
                raise LoRAAdapterError(
                    f"{where} targets {', '.join(missing)}, which {self.model.config.architecture} "
                    f"has no LoRA-capable projection named; it adapts {', '.join(adaptable)}"
                )
        out: Factors = {}
        for hf_name, (a, b) in adapter.weights.items():
            name = self._rename(hf_name + ".weight")
            if name is None:
                continue  # a part of the checkpoint this server does not run (a vision tower)
            module = name.removesuffix(".weight")
            if module not in self._targets:
                if not self.model.pp.holds_weight(name, False):
                    continue  # another pipeline stage's layer
                raise LoRAAdapterError(
                    f"{where} adapts {hf_name}, which is not a LoRA-capable projection of "
                    f"{self.model.config.architecture} (it adapts {', '.join(adaptable)})"
                )
            scaled = b.float() * adapter.config.scaling(hf_name)
            for table_name, src in self._targets[module]:
                self.tables[table_name].check(src, a, b, where)
                out.setdefault(table_name, []).append((src, a.float(), scaled))
        return out
