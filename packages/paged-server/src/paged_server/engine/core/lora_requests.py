"""The engine core's LoRA adapters: which are served, and the commands that
load and unload them on every rank.

The core never holds adapter weights: each rank's worker does
(``models/lora``'s ``LoRAManager``). Here are the adapters by name, as
requests and ``/v1/models`` know them, and the worker commands still to
send: ``take_ops`` hands them to the next step (``WorkerStep.lora_ops``),
so every rank loads and unloads in the same order as the steps and never
while a pass runs. An adapter is checked on rank 0 before it is accepted
(a bad one is refused at once, never at a step).

Unloading while requests use the adapter lets them finish: the name goes
at once (new requests for it are refused) and the weights when its last
request is done. An adapter's prefix-cache key (``key``) is a digest of
its files, so a name loaded again with other weights never meets the old
KV, while KV kept on disk (``--kv-disk-dir``) still serves it after a restart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from paged_server.lora_request import LoRARequest
from paged_server.models.lora.adapter import adapter_digest


class LoRARequests:
    """Adapters served by one engine (``--enable-lora``). ``check(name,
    path)``: why rank 0 cannot serve the adapter (None: it can)."""

    def __init__(self, enabled: bool, check: Callable[[str, str], str | None]) -> None:
        self.enabled = enabled
        self._check = check
        self.served: dict[str, LoRARequest] = {}
        self._keys: dict[str, bytes] = {}  # name -> its prefix-cache key, while loaded
        self._unloading: set[str] = set()  # unloaded names whose requests still run
        self._ops: list[tuple[str, ...]] = []

    def add(self, lora: LoRARequest) -> bool:
        """Serve ``lora``; False when it is served already (same name, path
        and id). Raises ``ValueError`` for a bad adapter or a name in use."""
        self._require()
        name = lora.lora_name
        known = self.served.get(name)
        if known is not None:
            if (known.lora_path, known.lora_int_id) == (lora.lora_path, lora.lora_int_id):
                return False
            raise ValueError(
                f"a LoRA adapter named {name!r} is already loaded (from {known.lora_path}); "
                "unload it first or choose another name"
            )
        if name in self._unloading:
            raise ValueError(
                f"LoRA adapter {name!r} is being unloaded (its last requests are finishing); "
                "load it again once they are done, or under another name"
            )
        if (why := self._check(name, lora.lora_path)) is not None:
            raise ValueError(why)
        self.served[name] = lora
        self._keys[name] = b"lora\0" + adapter_digest(lora.lora_path)
        self._ops.append(("add", name, lora.lora_path))
        return True

    def remove(self, name: str) -> None:
        """Stop serving ``name``: refused for new requests now, its weights
        dropped once no request uses it. ``KeyError`` if it is not served."""
        if name not in self.served:
            raise KeyError(name)
        del self.served[name]
        self._unloading.add(name)

    def for_request(self, lora: LoRARequest | None) -> str | None:
        """The adapter name a new request runs with (None: the base model),
        loading ``lora`` first if it is new (vLLM's offline use)."""
        if lora is None:
            return None
        self.add(lora)
        return lora.lora_name

    @property
    def active(self) -> bool:
        """Whether any adapter is loaded, being unloaded, or has commands due."""
        return bool(self._keys or self._ops)

    def key(self, name: str | None) -> bytes | None:
        """``name``'s prefix-cache key (None for the base model)."""
        return None if name is None else self._keys[name]

    def take_ops(self, in_use: Callable[[], Iterable[str | None]]) -> list[tuple[str, ...]]:
        """The commands the next step carries; ``in_use()``: the adapters of
        unfinished requests (read only while an unload is pending)."""
        if self._unloading:
            busy = set(in_use())
            for name in [n for n in self._unloading if n not in busy]:
                self._unloading.discard(name)
                self._keys.pop(name, None)
                self._ops.append(("remove", name))
        ops, self._ops = self._ops, []
        return ops

    def _require(self) -> None:
        if not self.enabled:
            raise ValueError(
                "LoRA adapters need the engine started with --enable-lora (LLM(enable_lora=True))"
            )
