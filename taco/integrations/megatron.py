"""Compressed TP inside Megatron-Core: route its tensor-parallel all-reduces through `taco.comm`.

    import taco.integrations.megatron as taco_megatron
    policy = taco.comm.CommPolicy(codec="taco")
    taco_megatron.enable(policy, model=model)        # model: optional, names the sites by module path
    ...                                              # train as usual; policy.stats has the bytes
    taco_megatron.disable()                          # or: with taco_megatron.compressed(policy, model):

Supported megatron-core versions: 0.16.x (verified with 0.16.1, the last release for Python 3.11;
`pip install 'taco-tp[megatron]'`). `enable()` raises on any other version: the patch points below
are read from that source, and a silent no-op on a renamed function would look like success.

What is routed (tensor parallelism without sequence parallelism; Megatron's SP path needs CUDA):
- `megatron.core.tensor_parallel.mappings._reduce`, looked up at call time by the mappings'
  autograd Functions: RowParallelLinear's forward all-reduce (site `{module}.fwd`) and the
  backward all-reduce of `copy_to_tensor_model_parallel_region` (site `megatron.copy_to.bwd`);
- the input-gradient all-reduce of ColumnParallelLinear, a direct
  `torch.distributed.all_reduce(grad_input, async_op=True)` in
  `LinearWithGradAccumulationAndAsyncCommunication.backward` (site `{module}.bwd`), which then
  computes the weight gradient, calls `handle.wait()` and returns `grad_input`: the patch returns
  a taco handle (the first transfer is already in flight, so Megatron's overlap is kept) whose
  `wait()` writes the reduced tensor into `grad_input`. It is reached through the name `torch` of
  `megatron.core.tensor_parallel.layers` only (a proxy of the torch module there; every other
  attribute is torch's own), so no other caller of `torch.distributed.all_reduce` is affected.
Module names come from `model` (forward hooks keep the module being run; a parameter's module for
the backward all-reduce); without `model` the sites are `megatron.row.fwd` / `megatron.column.bwd`.
`policy=None`, or a policy whose codec is none, runs the plain collectives: bit-identical to
unpatched Megatron, and so is everything after `disable()` (tests/integrations/test_integrations_megatron.py).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from .. import comm
from ..comm import CommPolicy

SUPPORTED = ("0.16",)
"""major.minor versions of megatron-core whose patch points were read and tested"""

_state: dict[str, Any] | None = None


def _megatron_version() -> str:
    try:
        from megatron.core import package_info
    except ImportError as e:
        raise ImportError(
            "taco.integrations.megatron needs megatron-core: pip install 'taco-tp[megatron]' "
            f"(megatron-core {', '.join(v + '.x' for v in SUPPORTED)})"
        ) from e
    return package_info.__version__


def _check_version() -> str:
    version = _megatron_version()
    if ".".join(version.split(".")[:2]) not in SUPPORTED:
        raise RuntimeError(
            f"taco.integrations.megatron: megatron-core {version} is not supported (supported: "
            f"{', '.join(v + '.x' for v in SUPPORTED)}); its tensor-parallel internals may differ, so "
            "nothing was patched. Install a supported version, or use taco.parallel's TP layers."
        )
    return version


def _kw(site: str) -> dict[str, Any]:
    policy = _state["policy"]
    return {"site": site, "codec": None} if policy is None else {"site": site, "policy": policy}


def _reduce(input_: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`mappings._reduce` through taco.comm (the original all-reduces in place and returns input_)."""
    assert group is not None, "group should not be None"
    if group.size() == 1:
        return input_
    if sys._getframe(1).f_code.co_name == "backward":
        site = "megatron.copy_to.bwd"
    else:
        stack = _state["stack"]
        site = f"{stack[-1]}.fwd" if stack else "megatron.row.fwd"
    return comm.all_reduce(input_, group, **_kw(site))


class _IntoTensor:
    """What Megatron gets for its async all-reduce: `wait()` finishes the taco collective and writes
    the sum into the tensor Megatron passed (and returns), as torch.distributed's in-place one does."""

    def __init__(self, handle: comm.Handle, out: torch.Tensor) -> None:
        self.handle, self.out = handle, out

    def wait(self) -> bool:
        self.out.copy_(self.handle.wait())
        return True

    def is_completed(self) -> bool:
        return self.handle.is_completed()


def _dgrad_all_reduce(tensor, group=None, op=dist.ReduceOp.SUM, async_op=False):
    """`torch.distributed.all_reduce` as `megatron.core.tensor_parallel.layers` sees it."""
    if op != dist.ReduceOp.SUM or not tensor.is_floating_point() or not tensor.is_contiguous():
        return dist.all_reduce(tensor, group=group, op=op, async_op=async_op)
    weight = sys._getframe(1).f_locals.get("weight")
    name = _state["names"].get(id(weight)) if weight is not None else None
    h = comm.all_reduce(tensor, group, async_op=True, **_kw(f"{name}.bwd" if name else "megatron.column.bwd"))
    work = _IntoTensor(h, tensor)
    if async_op:
        return work
    work.wait()
    return None


class _Proxy(types.ModuleType):
    """A module whose attributes are `real`'s except the ones given."""

    def __init__(self, real: types.ModuleType, **override: Any) -> None:
        super().__init__(real.__name__, real.__doc__)
        self.__dict__.update(override)
        self.__dict__["_real"] = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_real"], name)


def _hooks(model: torch.nn.Module, stack: list[str]) -> list[Any]:
    handles = []
    for name, mod in model.named_modules():
        if not name:
            continue
        handles.append(mod.register_forward_pre_hook(lambda m, a, name=name: stack.append(name)))
        handles.append(mod.register_forward_hook(lambda m, a, o: stack.pop() and None, always_call=True))
    return handles


def enable(policy: CommPolicy | None, model: torch.nn.Module | None = None) -> None:
    """Route Megatron-Core's TP all-reduces through `taco.comm` with `policy` (None: plain, exact).

    Raises RuntimeError on an unsupported megatron-core version or when already enabled."""
    global _state
    if policy is not None and not isinstance(policy, CommPolicy):
        raise TypeError(f"policy must be a taco.comm.CommPolicy or None, got {type(policy).__name__}")
    version = _check_version()
    if _state is not None:
        raise RuntimeError("taco.integrations.megatron is already enabled; call disable() first")
    from megatron.core.tensor_parallel import layers, mappings

    if not callable(getattr(mappings, "_reduce", None)) or getattr(layers, "torch", None) is not torch:
        raise RuntimeError(
            f"taco.integrations.megatron: megatron-core {version} lacks the patch points "
            "(tensor_parallel.mappings._reduce, tensor_parallel.layers.torch); nothing was patched"
        )
    stack: list[str] = []
    names = {}
    if model is not None:
        for mname, mod in model.named_modules():
            for p in mod.parameters(recurse=False):
                names[id(p)] = mname
    _state = {
        "policy": policy,
        "version": version,
        "stack": stack,
        "names": names,
        "saved": (mappings._reduce, layers.torch),
        "hooks": _hooks(model, stack) if model is not None else [],
    }
    mappings._reduce = _reduce
    layers.torch = _Proxy(torch, distributed=_Proxy(dist, all_reduce=_dgrad_all_reduce))


def disable() -> None:
    """Undo `enable()` (a no-op when not enabled): Megatron runs its own collectives again."""
    global _state
    if _state is None:
        return
    from megatron.core.tensor_parallel import layers, mappings

    mappings._reduce, layers.torch = _state["saved"]
    for h in _state["hooks"]:
        h.remove()
    _state = None


def enabled() -> bool:
    return _state is not None


@contextmanager
def compressed(
    policy: CommPolicy | None, model: torch.nn.Module | None = None
) -> Iterator[CommPolicy | None]:
    """`enable(policy, model)` for the block, `disable()` after it (also on errors)."""
    enable(policy, model)
    try:
        yield policy
    finally:
        disable()


__all__ = ["SUPPORTED", "compressed", "disable", "enable", "enabled"]
