"""LoRA adapters on the model families' projections: many fine-tunes of one
base model served side by side, mixed in one batch.

- ``adapter.py``: PEFT's adapter directories read and checked
  (``read_adapter``, ``LoRAAdapterConfig``).
- ``slots.py``: ``SlotTable``, which adapter is in which device slot (LRU).
- ``layers.py``: each projection's slot table (``LoRAWeights``: stacked A
  and B padded to ``max_lora_rank``) and where an adapter's factors go on
  this tensor-parallel rank; ``attach`` gives a model its tables.
- ``manager.py``: ``LoRAManager`` (add / remove / activate / ``mapping``),
  the engine's one handle, and ``LoRAConfig`` (vLLM's limits).

The step's ``LoRAMapping`` and the ops that apply it live below the
server, in ``paged_ref.lora_ops`` and ``paged_triton.lora_ops``, beside
the attention ops.
"""

from __future__ import annotations

from paged_ref.lora_ops import LoRAMapping
from paged_server.models.lora.adapter import LoRAAdapter, LoRAAdapterConfig, read_adapter
from paged_server.models.lora.layers import LoRAWeights, attach, detach
from paged_server.models.lora.manager import LoRAConfig, LoRAManager
from paged_server.models.lora.slots import SlotTable

__all__ = [
    "LoRAAdapter",
    "LoRAAdapterConfig",
    "LoRAConfig",
    "LoRAManager",
    "LoRAMapping",
    "LoRAWeights",
    "SlotTable",
    "attach",
    "detach",
    "read_adapter",
]
