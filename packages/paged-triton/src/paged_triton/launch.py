"""One kernel launch as data.

Each op's wrapper *plans* its launches (grid, arguments, constexprs, warps,
stages) in a pure host function and then runs them. The compile matrix
(``compile_matrix.py``) calls the same planning functions on ``meta``
tensors, so what it compiles ahead of time for a GPU is exactly what the
ops would launch there, down to Triton's specialisation of each argument.
Within one step, a :class:`Replay` kept in the step's ``memo`` lets every
layer after the first skip the checks and the planning; :func:`run_planned`
is that replay-or-check / plan / autotune / run / remember sequence, the one
path of both attention ops. :func:`specialize` derives what Triton's JIT compiles from a launch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from paged_triton.launch_checks import compute_dtype, kv_quant_mode, scale_args
from paged_triton.tile_config import MIN_DOT, autotune_enabled, candidates, tuned

# Planning for a GPU from a machine without one (the compile matrix) uses this arch.
SPECIALISE_FOR = 90


@dataclass(slots=True)
class Launch:
    """``kernel[grid](*args, **constexprs, num_warps=..., num_stages=...)``
    (and ``maxnreg``, a register cap per thread, when set)."""

    kernel: Any  # a triton JITFunction, or InterpretedFunction under TRITON_INTERPRET=1
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int
    maxnreg: int | None = None

    @property
    def options(self) -> dict[str, int]:
        """Compiler options: what ``triton.compile`` takes besides the source."""
        out = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.maxnreg is not None:
            out["maxnreg"] = self.maxnreg
        return out

    def run(self, args: tuple[Any, ...] | list[Any] | None = None) -> None:
        """Launch (with ``args`` instead of the planned arguments if given)."""
        self.kernel[self.grid](
            *(self.args if args is None else args), **self.constexprs, **self.options
        )


@dataclass(slots=True)
class Replay:
    """A layer's planned launches, replayed for the next layers of the same
    step with only their own tensors swapped in (the ops keep it in the
    step's ``memo``): every layer of a step has the same shapes, block
    tables and lengths, so checks and planning run once per step, not once
    per layer. ``where[i]`` gives, for launch ``i``, the argument position
    of each per-layer tensor (-1: not an argument of that launch)."""

    launches: Sequence[Launch]
    where: Sequence[tuple[int, ...]]

    def run(self, *tensors: Any) -> None:
        for launch, positions in zip(self.launches, self.where, strict=True):
            args = list(launch.args)
            for position, tensor in zip(positions, tensors, strict=True):
                if position >= 0:
                    args[position] = tensor
            launch.run(args)


def run_planned(
    kind: str,
    plan: Callable[..., list[Launch]],
    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    scales: dict[str, torch.Tensor],
    *,
    check: Callable[[], bool],
    args: Callable[[int | None], tuple[Any, ...]],
    memo: dict[Any, Any] | None,
    step_key: tuple[Any, ...],
    traits: tuple[Any, ...],
    where: Sequence[tuple[int, ...]],
) -> None:
    """Run an attention op over ``tensors`` (q, k_cache, v_cache, out).

    With ``memo`` (the step's dict), a plan an earlier layer left there under
    the same ``step_key`` (what the plan assumed besides the tensors' layout:
    metadata tensors' ids, scale, window, ...) is replayed with this layer's
    tensors, skipping the checks. Otherwise ``check()`` raises on bad
    arguments and says whether there is anything to compute; then the
    launches are planned (``plan(*args(arch), tile=..., **scales)``; the tile
    timed once per shape when autotuning is on), run, and kept in ``memo``.
    ``traits`` (window? softcap?) pick tiles with the shapes; ``where[i]``:
    launch ``i``'s positions of q, k, v, k_scale, v_scale, out."""
    q, k_cache, v_cache, out = tensors
    key = None
    if memo is not None and q.stride(-1) == 1:
        key = (f"paged_triton.{kind}", *step_key, tensor_key(q), tensor_key(k_cache),
               tensor_key(v_cache), tuple(scales))  # fmt: skip
        replay = memo.get(key)
        if replay is not None:
            k_scale, v_scale, _ = scale_args(
                k_cache, v_cache, scales.get("k_scales"), scales.get("v_scales"),
                scales.get("k_head_scales"), scales.get("v_head_scales"),
            )  # fmt: skip
            replay.run(q, k_cache, v_cache, k_scale, v_scale, out)
            return
    if not check():
        return
    arch = device_arch(q.device)
    planned = args(arch)
    tile = None
    if autotune_enabled(q.device):
        import triton

        block_d = max(MIN_DOT, triton.next_power_of_2(q.shape[2]))
        dtype = compute_dtype(q.dtype, k_cache.dtype)
        options = candidates(kind, block_d, dtype, arch, kv_quant_mode(k_cache.dtype) != 0)
        tune_key = (kind, q.shape[1:], q.dtype, k_cache.shape[1:], k_cache.dtype, arch, traits)
        tile = tuned(tune_key, options, lambda t: _time_ms(plan(*planned, tile=t, **scales)))
    launches = plan(*planned, tile=tile, **scales)
    for launch in launches:
        launch.run()
    if memo is not None and key is not None:
        memo[key] = Replay(launches, where[: len(launches)])


def _time_ms(launches: list[Launch]) -> float:
    import triton.testing

    def step() -> None:
        for launch in launches:
            launch.run()

    return float(triton.testing.do_bench(step))


def _flags(kernel: Any) -> tuple[set[str], set[str]]:
    """Parameter names with ``do_not_specialize`` / ``..._on_alignment``
    (a JITFunction, or an InterpretedFunction under the interpreter)."""
    if hasattr(kernel, "params"):
        dns = {p.name for p in kernel.params if p.do_not_specialize}
        dns_oa = {p.name for p in kernel.params if p.do_not_specialize_on_alignment}
        return dns, dns_oa
    kwargs = getattr(kernel, "kwargs", {})
    return set(kwargs.get("do_not_specialize") or ()), set(
        kwargs.get("do_not_specialize_on_alignment") or ()
    )


def specialize(launch: Launch, arch: int) -> tuple[dict[str, str], dict[str, Any], dict]:
    """Signature, constexprs and attributes as Triton's JIT derives them from
    these arguments on a GPU of ``arch`` (same C++ specialisation routine)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import native_specialize_impl

    backend = make_backend(GPUTarget("cuda", arch, 32))
    fn = launch.kernel
    names = list(fn.arg_names)
    dns, dns_oa = _flags(fn)
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    args = iter(launch.args)
    for index, name in enumerate(names):
        if name in launch.constexprs:
            signature[name] = "constexpr"
            constexprs[name] = launch.constexprs[name]
            continue
        arg = next(args)
        ty, key = native_specialize_impl(backend, arg, False, name not in dns, name not in dns_oa)
        if ty == "constexpr":  # Triton folds an int argument equal to 1 into the kernel
            signature[name] = "constexpr"
            constexprs[name] = key
            continue
        signature[name] = ty
        if isinstance(key, str) and key:
            attrs[(index,)] = backend.parse_attr(key)
    if next(args, None) is not None:
        raise ValueError(f"{fn.__name__}: more arguments than parameters")
    return signature, constexprs, attrs


def variant_key(launch: Launch, arch: int | None = None) -> tuple[Any, ...]:
    """The kernel, signature, constexprs, argument attributes and compiler
    options Triton's JIT derives from ``launch`` on a GPU of ``arch``
    (default sm_90: the specialisation rules are the same on every NVIDIA
    GPU): two launches with the same key run the same compiled kernel."""
    signature, constexprs, attrs = specialize(launch, arch or SPECIALISE_FOR)
    return (
        launch.kernel.__name__,
        tuple(signature.items()),
        tuple(sorted((k, repr(v)) for k, v in constexprs.items())),
        tuple(sorted((k, repr(v)) for k, v in attrs.items())),
        tuple(sorted(launch.options.items())),
    )


def tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    """What a planned launch assumed about ``t``: shape, strides, dtype, device."""
    return (t.shape, t.stride(), t.dtype, t.is_cuda, t.get_device())


def device_arch(device: torch.device) -> int | None:
    """Compute capability as ``10 * major + minor`` (80, 89, 90, ...) for a
    CUDA device; ``None`` elsewhere (Triton's CPU interpreter)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_arch(index)


@functools.cache
def _cuda_arch(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor
