"""What an attention backend is: ``AttentionBackend``.

One object per backend (the reference ops, the CPU's C kernels, the Triton
kernels), as mini-sglang's ``BaseAttnBackend`` or vLLM's backend classes:
a view hands it one layer's step (``attend``), the pool its writes and
block copies, and the engine reads its capability flags instead of
comparing backend names or device types. ``paged_server.attention_backends``
names every one (one line each) and picks one from the resolved config.

paged-core holds no tensors: tensors and the step's metadata are ``Any``
here; ``paged_ref.ops_backend`` documents their shapes.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

Tensor = Any  # torch.Tensor in the backends; core stays torch-free.


@runtime_checkable
class AttentionBackend(Protocol):
    """One attention backend: its capability flags, then its calls.

    The flags are class attributes, read before any tensor exists (the
    config's resolution, the worker's choice of compiled pass, decode graphs
    and warm-up):

    - ``name``: the ``attention_backend`` value that selects it;
    - ``device_types``: the devices it runs on (``unavailable`` says why not);
    - ``auto_for``: the devices where ``attention_backend="auto"`` picks it;
    - ``graph_safe``: its ops replay inside a CUDA graph (no host sync);
    - ``compilable``: a CPU forward pass over it may be ``torch.compile``d;
    - ``compiled_variant``: the backend a compiled pass runs instead (or None);
    - ``needs_warmup``: its kernels compile on first launch (``warm_up`` first);
    - ``kv_dtypes`` / ``block_sizes``: the ``kv_cache_dtype`` names and block
      sizes it takes, None for all.
    """

    name: str
    device_types: tuple[str, ...]
    auto_for: tuple[str, ...]
    graph_safe: bool
    compilable: bool
    compiled_variant: str | None
    needs_warmup: bool
    kv_dtypes: tuple[str, ...] | None
    block_sizes: tuple[int, ...] | None

    @classmethod
    def unavailable(cls, device_type: str) -> str | None:
        """Why it cannot run on ``device_type`` (one line saying what to do), or None."""
        ...

    @property
    def ops(self) -> Any:
        """The four ops it runs (``write_kv``, ``paged_decode_attention``,
        ``paged_prefill_attention``, ``copy_blocks``; docs/contracts.md)."""
        ...

    def attend(
        self, k_cache: Tensor, v_cache: Tensor, meta: Any, q: Tensor, k: Tensor, v: Tensor, *,
        scale: float, sliding_window: int | None, softcap: float | None, scales: dict[str, Tensor],
    ) -> Tensor:  # fmt: skip
        """One layer of a step: write ``k``/``v`` (``[num_tokens, kv_heads,
        head_dim]``) at ``meta.slot_mapping`` and attend ``q`` (``[num_tokens,
        heads, head_dim]``) over each sequence's cached + new keys; returns
        ``q``'s shape. ``scales``: the layer's 8-bit scales as the ops' keywords."""
        ...

    def write_kv(self, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor,
                 **scales: Tensor) -> None:  # fmt: skip
        """Write only (a view's ``update``, which gathers the context itself)."""
        ...

    def copy_blocks(self, k_caches: Tensor, v_caches: Tensor, src_to_dst: Any, **scales: Tensor) -> None:
        """Copy whole blocks in every layer (copy-on-write)."""
        ...

    def graph_step(self, meta: Any) -> None:
        """Before each run of a decode graph's static metadata (captured or
        replayed): forget what was derived from the last step's."""
        ...

    def warm_up(self, layout: Any, device: Any) -> Any:
        """Compile every kernel variant ``layout`` (the model's attention
        over the pool) can launch; None where nothing compiles."""
        ...

    def lora_ops(self, device_type: str) -> Any:
        """The LoRA kernels to run beside it on ``device_type`` (None: the reference's)."""
        ...

    def layer_ops(self, device_type: str) -> Any:
        """Fused norm/RoPE/activation kernels for the model's layers on
        ``device_type`` (None: the models' eager PyTorch ops)."""
        ...
