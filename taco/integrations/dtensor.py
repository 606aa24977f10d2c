"""DTensor parallel styles whose TP collectives go through `taco.comm` (torchtitan-style plans).

    plan = {"attention.wq": TacoColwiseParallel(policy=policy, site="layers.0.attention.wq"),
            "attention.wo": TacoRowwiseParallel(policy=policy, site="layers.0.attention.wo"), ...}
    parallelize_module(block, tp_mesh, plan)            # weights stay DTensors (DCP works as before)
    parallelize_module(block, tp_mesh, taco_plan(stock_plan, policy, prefix="layers.0."))

Why this file exists: a torchtitan user changes the style classes of a plan and nothing else. The
styles subclass torch's ColwiseParallel/RowwiseParallel and override only `_prepare_input_fn` and
`_prepare_output_fn` (partitioning, DCP and the module's own DTensor math are torch's). The
communication runs on local tensors in `taco.parallel.mappings`' autograd Functions, and
`DTensor.from_local(..., grad_placements=(Partial(),))` / `to_local(grad_placements=...)` tell
DTensor that the gradient is already (or not yet) reduced, so DTensor adds no collective of its own:

- colwise, input Replicate: forward identity, backward all-reduce (site `{site}.bwd`);
- colwise, input Shard(1) (sequence parallel): all-gather, backward reduce-scatter (`{site}.fwd/.bwd`);
- rowwise, output Replicate: all-reduce, backward identity (`{site}.fwd`);
- rowwise, output Shard(1) (sequence parallel): reduce-scatter, backward all-gather;
- TacoPrepareModuleInput, Shard(1) -> Replicate (torchtitan's SP entry into attention/MLP):
  all-gather, backward reduce-scatter of the branches' summed gradient (`{site}.fwd/.bwd`).

Other layouts, DTensor or integer inputs and Embeddings' masked partial sums take the stock path,
uncompressed. `policy=None` (or a policy
whose codec is none) runs the plain collectives: outputs and gradients are bit-identical to the
stock styles (tests/integrations/test_integrations_dtensor.py). One-dimensional TP meshes only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from ..comm import CommPolicy
from ..parallel import mappings
from ..parallel.regions import SEQ_DIM, TPContext


def _ctx(device_mesh: Any, policy: CommPolicy | None, sp: bool) -> TPContext:
    if device_mesh.ndim != 1:
        raise ValueError(f"taco DTensor styles need a 1-D TP mesh, got {device_mesh.ndim} dims")
    return TPContext(group=device_mesh.get_group(), policy=policy, sp=sp)


def _is_seq_shard(p: Any, ndim: int) -> bool:
    return isinstance(p, Shard) and p.dim % ndim == SEQ_DIM


class TacoColwiseParallel(ColwiseParallel):
    """`ColwiseParallel` with the input's collective (backward all-reduce, or the SP all-gather)
    compressed by `policy` at site `{site}.bwd` / `{site}.fwd`; keyword arguments as torch's."""

    def __init__(self, *, policy: CommPolicy | None = None, site: str = "tp.colwise", **kw: Any) -> None:
        super().__init__(**kw)
        self.policy, self.site = policy, site

    def _prepare_input_fn(self, input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        x = inputs[0]
        layout = input_layouts[0]
        seq = not isinstance(x, DTensor) and _is_seq_shard(layout, x.dim())
        local = not isinstance(x, DTensor) and x.is_floating_point()  # token ids (Embedding): stock
        if not local or not (isinstance(layout, Replicate) or seq):
            stock = ColwiseParallel._prepare_input_fn
            return stock(input_layouts, desired_input_layouts, mod, inputs, device_mesh)
        ctx = _ctx(device_mesh, self.policy, sp=seq)
        y = mappings.tp_input(x, ctx, self.site)
        # the gradient reaching from_local is this rank's partial sum: the Function above reduces it
        return DTensor.from_local(
            y, device_mesh, (Replicate(),), run_check=False, grad_placements=(Partial(),)
        )

    def __repr__(self) -> str:
        return f"Taco{super().__repr__()[:-1]}, site={self.site!r}, policy={self.policy is not None})"


class TacoRowwiseParallel(RowwiseParallel):
    """`RowwiseParallel` with the output's collective (all-reduce, or the SP reduce-scatter)
    compressed by `policy` at site `{site}.fwd` (and `{site}.bwd` for SP); keyword arguments as torch's."""

    def __init__(self, *, policy: CommPolicy | None = None, site: str = "tp.rowwise", **kw: Any) -> None:
        super().__init__(**kw)
        self.policy, self.site = policy, site

    def _prepare_output_fn(self, output_layouts, use_local_output, mod, outputs, device_mesh):
        layout = output_layouts[0]
        # a plain sum: not an Embedding's MaskPartial, whose reduction also masks rows
        partial = all(type(p) is Partial and p.reduce_op == "sum" for p in outputs.placements)
        seq = _is_seq_shard(layout, outputs.dim())
        if not partial or not (isinstance(layout, Replicate) or seq):
            stock = RowwiseParallel._prepare_output_fn
            return stock(output_layouts, use_local_output, mod, outputs, device_mesh)
        ctx = _ctx(device_mesh, self.policy, sp=seq)
        local = outputs.to_local(grad_placements=(Replicate(),))
        y = mappings.tp_output(local, ctx, self.site)
        if use_local_output:
            return y
        return DTensor.from_local(y, device_mesh, (layout,), run_check=False)

    def __repr__(self) -> str:
        return f"Taco{super().__repr__()[:-1]}, site={self.site!r}, policy={self.policy is not None})"


class TacoPrepareModuleInput(PrepareModuleInput):
    """`PrepareModuleInput` whose sequence-parallel all-gather (an input `Shard(1)` -> `Replicate()`,
    torchtitan's entry into attention and MLP) is compressed by `policy`: all-gather at `{site}.fwd`,
    the reduce-scatter of the summed gradient at `{site}.bwd`. Other arguments as torch's."""

    def __init__(self, *, policy: CommPolicy | None = None, site: str = "tp.input", **kw: Any) -> None:
        super().__init__(**kw)
        self.policy, self.site = policy, site

    def _prepare_input_arg(self, input, mesh, input_layout, desired_layout):
        if not (
            isinstance(input, torch.Tensor)
            and _is_seq_shard(input_layout, input.dim())
            and isinstance(desired_layout, Replicate)
        ):
            return super()._prepare_input_arg(input, mesh, input_layout, desired_layout)
        if isinstance(input, DTensor):
            if input.placements != (input_layout,):
                input = input.redistribute(placements=(input_layout,))
            input = input.to_local()  # its gradient: this rank's sequence shard
        y = mappings.gather_from_sequence_parallel_region(input, _ctx(mesh, self.policy, sp=True), self.site)
        if self.use_local_output:
            return y
        return DTensor.from_local(y, mesh, (Replicate(),), run_check=False, grad_placements=(Partial(),))


def taco_plan(plan: dict[str, Any], policy: CommPolicy | None, prefix: str = "") -> dict[str, Any]:
    """A copy of a `parallelize_module` plan with every Colwise/RowwiseParallel replaced by its taco
    style (same layouts), and every PrepareModuleInput by TacoPrepareModuleInput, site `{prefix}{key}`;
    other styles are kept as they are."""
    out: dict[str, Any] = {}
    for key, style in plan.items():
        kw = {"policy": policy, "site": prefix + key}
        if type(style) is ColwiseParallel or type(style) is RowwiseParallel:
            cls = TacoColwiseParallel if type(style) is ColwiseParallel else TacoRowwiseParallel
            out[key] = cls(
                input_layouts=style.input_layouts[0],
                output_layouts=style.output_layouts[0],
                use_local_output=style.use_local_output,
                **kw,
            )
        elif type(style) is PrepareModuleInput:
            out[key] = TacoPrepareModuleInput(
                input_layouts=style.input_layouts,
                desired_input_layouts=style.desired_input_layouts,
                input_kwarg_layouts=style.input_kwarg_layouts if style.with_kwargs else None,
                desired_input_kwarg_layouts=style.desired_input_kwarg_layouts if style.with_kwargs else None,
                use_local_output=style.use_local_output,
                **kw,
            )
        else:
            out[key] = style
    return out


__all__ = ["TacoColwiseParallel", "TacoPrepareModuleInput", "TacoRowwiseParallel", "taco_plan"]
