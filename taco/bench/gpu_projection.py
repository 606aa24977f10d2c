"""The cost model carried to GPU clusters: step time and TACO's speedup per model, TP degree and link.

Why this file exists: `cost_model.py` holds the alpha-beta model that the emulated runs of
`cluster.py` validate; this file applies it to GPU clusters under stated assumptions (peak FLOP/s
and MFU, HBM bandwidth of a memory-bound codec, per-link bandwidth and latency: `assumptions()`),
answering "for which model, TP degree and link does compression pay, and by how much".

    python -m taco.bench.gpu_projection --plot docs/cluster_projection.png

Per transformer layer and micro-batch there are 2 TP collectives forward and 2 backward of
b*s*h elements (Megatron placement, docs/design.md 1.4), plus the vocab-parallel embedding (forward)
and LM-head input (backward) all-reduces on the first/last pipeline stage.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

from .cost_model import CodecCost, Link, Message, collective_time, gbit, ideal_speedup

__all__ = ["GPT_13B", "QWEN25_7B", "Hardware", "ModelShape", "Parallel", "StepBreakdown", "assumptions",
           "format_projection", "gpu_codec", "projection", "step_time", "tp_messages"]  # fmt: skip

# ----------------------------------------------------------------------------- GPU clusters


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape (what the FLOPs and the TP messages depend on)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    gated_mlp: bool = False
    """SwiGLU (3 matrices) instead of GELU (2)"""

    def matmul_params(self) -> int:
        """Weights that multiply activations per token: attention, MLP, and the LM head."""
        head_dim = self.hidden // self.heads
        attn = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.ffn
        return self.layers * (attn + mlp) + self.vocab * self.hidden

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 per matmul weight, plus causal attention 6 * L * s * h."""
        return 6.0 * self.matmul_params() + 6.0 * self.layers * self.seq * self.hidden


GPT_13B = ModelShape(
    "GPT-13B", layers=40, hidden=5120, heads=40, kv_heads=40, ffn=20480, vocab=50257, seq=2048
)
QWEN25_7B = ModelShape("Qwen2.5-7B", layers=28, hidden=3584, heads=28, kv_heads=4, ffn=18944, vocab=152064,
                       seq=4096, gated_mlp=True)  # fmt: skip


@dataclass(frozen=True)
class Parallel:
    """The mesh and batch of one step: micro-batch b sequences, m micro-batches per DP rank."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    sp: bool = False
    micro_batch: int = 1
    microbatches: int = 1


@dataclass(frozen=True)
class Hardware:
    """Per-rank compute and the links of each mesh axis."""

    name: str
    flops: float
    """achieved FLOP/s per rank on the model's matmuls (peak x MFU)"""
    tp_link: Link
    pp_link: Link | None = None
    dp_link: Link | None = None


@dataclass(frozen=True)
class StepBreakdown:
    compute_s: float
    tp_s: float
    """exposed TP collective time (wire + coding), whole step"""
    pp_s: float
    dp_s: float
    bubble_s: float
    total_s: float

    @property
    def tp_share(self) -> float:
        """f: the TP communication share of the step."""
        return self.tp_s / self.total_s if self.total_s else 0.0


def tp_messages(shape: ModelShape, par: Parallel, comm_bytes: float = 2.0) -> list[Message]:
    """The TP collectives of one micro-batch on the busiest pipeline stage (docs/design.md 1.4)."""
    n = par.micro_batch * shape.seq * shape.hidden
    per_layer = (
        [Message("all_gather", n, comm_bytes), Message("reduce_scatter", n, comm_bytes)] * 2
        if par.sp
        else [Message("all_reduce", n, comm_bytes)] * 2
    )
    layers = math.ceil(shape.layers / par.pp)
    msgs = per_layer * 2 * layers  # forward and backward
    msgs += [Message("all_reduce", n, comm_bytes)] * (2 if par.pp == 1 else 1)  # embedding, LM head
    return msgs


def step_time(
    shape: ModelShape,
    par: Parallel,
    hw: Hardware,
    codec: CodecCost | None = None,
    slices: int = 1,
    comm_bytes: float = 2.0,
    grad_bytes: float = 4.0,
    dp_overlap: float = 0.8,
) -> StepBreakdown:
    """Step time of a (shape, mesh, hardware, TP codec) configuration.

    Compute: FLOPs / (tp * pp) at `hw.flops`, per micro-batch. TP: `tp_messages` through
    `collective_time` on `hw.tp_link`. PP: 1F1B, (m + pp - 1) stage slots, each with one
    activation send forward and one gradient send backward (plain, `comm_bytes`), bubble =
    (pp - 1) slots. DP: ring all-reduce of this rank's gradients (`grad_bytes` each) over
    `hw.dp_link`, a fraction `dp_overlap` hidden behind the backward pass.
    """
    tokens = par.micro_batch * shape.seq
    compute_mb = shape.flops_per_token() * tokens / (par.tp * par.pp) / hw.flops
    tp_mb = sum(
        collective_time(m.op, m.numel, m.elem_bytes, par.tp, hw.tp_link, codec, slices).total_s
        for m in tp_messages(shape, par, comm_bytes)
    )
    pp_mb = 0.0
    if par.pp > 1:
        link = hw.pp_link or hw.tp_link
        pp_mb = 2 * collective_time("send", tokens * shape.hidden, comm_bytes, 2, link).total_s
    slots = par.microbatches + par.pp - 1
    stage = compute_mb + tp_mb + pp_mb
    dp_s = 0.0
    if par.dp > 1:
        link = hw.dp_link or hw.tp_link
        params = (shape.matmul_params() + shape.vocab * shape.hidden) / (par.tp * par.pp)  # + input embedding
        dp_s = (1 - dp_overlap) * collective_time("all_reduce", int(params), grad_bytes, par.dp, link).total_s
    return StepBreakdown(
        compute_s=compute_mb * par.microbatches,
        tp_s=tp_mb * par.microbatches,
        pp_s=pp_mb * par.microbatches,
        dp_s=dp_s,
        bubble_s=stage * (par.pp - 1),
        total_s=stage * slots + dp_s,
    )


# ----------------------------------------------------------------------------- stated assumptions

H100_PEAK_BF16 = 989e12
"""dense bf16 FLOP/s of an H100/H200 SXM (H200: same compute, more HBM bandwidth)"""
MFU = 0.5
"""fraction of peak the matmuls reach with communication excluded"""
HBM = {"H100": 3.35e12, "H200": 4.8e12}
"""HBM bytes/s"""
CODEC_HBM_FRACTION = 0.4
"""a GPU codec pass streams at this fraction of HBM bandwidth (the codec is memory-bound)"""
TACO_BYTES_PER_ELEM = 1 + 8 / 128
CODEC_TOUCHED_BYTES = 2 + TACO_BYTES_PER_ELEM
"""HBM bytes per element of an encode (read bf16, write wire) or a decode (read wire, write bf16)"""

LINKS = {
    "NVLink4": Link("NVLink4 (H100 SXM, NVSwitch)", 360e9, 3e-6),
    "PCIe5": Link("PCIe Gen5 x16", 45e9, 10e-6),
    "PCIe4": Link("PCIe Gen4 x16", 22e9, 10e-6),
    "IB400": Link("400 Gbit/s inter-node", 0.9 * gbit(400), 20e-6),
    "IB200": Link("200 Gbit/s inter-node", 0.9 * gbit(200), 20e-6),
    "IB100": Link("100 Gbit/s inter-node", 0.9 * gbit(100), 20e-6),
}
"""achieved per-rank bandwidth (bytes/s, one direction) and per-hop latency of each link class"""


def gpu_codec(gpu: str = "H100") -> CodecCost:
    """The TACO codec on a GPU under the stated assumptions (memory-bound encode and decode)."""
    rate = CODEC_HBM_FRACTION * HBM[gpu] / CODEC_TOUCHED_BYTES
    return CodecCost(f"taco@{gpu}", TACO_BYTES_PER_ELEM, rate, rate)


def projection(
    shapes: tuple[ModelShape, ...] = (GPT_13B, QWEN25_7B),
    tps: tuple[int, ...] = (2, 4, 8),
    links: tuple[str, ...] = tuple(LINKS),
    gpus: tuple[str, ...] = ("H100", "H200"),
    micro_tokens: int = 4096,
    slices: int = 4,
) -> list[dict]:
    """Rows of the GPU-cluster table: one per (shape, tp, link), speedup per GPU's codec."""
    rows = []
    for shape in shapes:
        par_b = max(1, micro_tokens // shape.seq)
        for tp in tps:
            par = Parallel(tp=tp, micro_batch=par_b)
            for key in links:
                hw = Hardware(key, H100_PEAK_BF16 * MFU, LINKS[key])
                base = step_time(shape, par, hw)
                row = dict(model=shape.name, tp=tp, link=key, link_name=LINKS[key].name,
                           link_gbs=LINKS[key].bandwidth / 1e9,
                           compute_ms=base.compute_s * 1e3, tp_ms=base.tp_s * 1e3, f=base.tp_share,
                           r=2.0 / TACO_BYTES_PER_ELEM)  # fmt: skip
                row["ideal"] = ideal_speedup(row["f"], row["r"])
                for gpu in gpus:
                    comp = step_time(shape, par, hw, gpu_codec(gpu), slices)
                    row[f"taco_tp_ms_{gpu}"] = comp.tp_s * 1e3
                    row[f"speedup_{gpu}"] = base.total_s / comp.total_s
                rows.append(row)
    return rows


def format_projection(rows: list[dict], gpus: tuple[str, ...] = ("H100", "H200")) -> str:
    """A markdown table of `projection` rows."""
    head = ["model", "TP", "link", "compute ms", "TP bf16 ms", "f", "ideal"]
    head += [f"TACO TP ms ({g})" for g in gpus] + [f"speedup ({g})" for g in gpus]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["model"], str(r["tp"]), r["link"], f"{r['compute_ms']:.1f}", f"{r['tp_ms']:.1f}",
                 f"{r['f']:.2f}", f"{r['ideal']:.2f}"]  # fmt: skip
        cells += [f"{r[f'taco_tp_ms_{g}']:.1f}" for g in gpus] + [f"{r[f'speedup_{g}']:.2f}x" for g in gpus]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def assumptions() -> str:
    """The stated numbers behind `projection`, one line each (printed next to the table)."""
    lines = [
        f"- compute: {H100_PEAK_BF16 / 1e12:.0f} TFLOP/s dense bf16 peak x MFU {MFU} "
        f"= {H100_PEAK_BF16 * MFU / 1e12:.0f} TFLOP/s per GPU (H100 and H200 alike)",
        f"- TACO codec: {TACO_BYTES_PER_ELEM} B/elem on the wire; encode and decode each stream "
        f"{CODEC_TOUCHED_BYTES:.2f} B/elem of HBM at {CODEC_HBM_FRACTION:.0%} of its bandwidth: "
        + ", ".join(f"{g} {gpu_codec(g).encode_rate / 1e9:.0f} Gelem/s" for g in HBM),
        "- links (per rank, one direction, achieved): "
        + "; ".join(
            f"{k} {v.bandwidth / 1e9:.1f} GB/s, {v.alpha * 1e6:.0f} us/hop" for k, v in LINKS.items()
        ),
        "- plain all-reduce = ring (NCCL); compressed = two-shot (gather at TP=2), 4 slices overlap "
        "coding and wire",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    desc = __doc__.split("\n")[0]
    p = argparse.ArgumentParser(prog="python -m taco.bench.gpu_projection", description=desc)
    p.add_argument("--micro-tokens", type=int, default=4096, help="tokens per micro-batch (b * s)")
    p.add_argument("--slices", type=int, default=4)
    p.add_argument("--tp", default="2,4,8", help="comma list of TP degrees")
    p.add_argument("--plot", default=None, metavar="PNG", help="modeled speedup vs TP link bandwidth (H100)")
    args = p.parse_args(argv)
    tps = tuple(int(t) for t in args.tp.split(","))
    rows = projection(tps=tps, micro_tokens=args.micro_tokens, slices=args.slices)
    print(format_projection(rows))
    print()
    print(assumptions())
    if args.plot:
        from .plots import plot_projection

        plot_projection(rows, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
