"""`taco plan`: the plan of a config on a named GPU and link, as a table, as JSON, or as an error.

Why this file exists: `plan.py` counts bytes; this file adds the hardware (a table of GPUs and
link classes whose every number the user can override on the command line), the predicted step
time of each TP codec from the alpha-beta cost model (`taco.bench.cost_model.collective_time`, the
assumptions of `taco.bench.gpu_projection`), the verdict "fits or not, and what to change", and
the printing. Nothing here starts a rank or touches a GPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from taco.bench.cost_model import CodecCost, Link, collective_time, gbit
from taco.bench.gpu_projection import CODEC_HBM_FRACTION, LINKS, MFU
from taco.train import plan as P
from taco.train.config import Config
from taco.train.perf import GPU_PEAK_TFLOPS

GiB = 2**30


@dataclass(frozen=True)
class Gpu:
    """One GPU as the plan sees it (vendors' data sheets, dense, no sparsity)."""

    name: str
    bf16_tflops: float
    fp32_tflops: float
    hbm_gbs: float
    """HBM bandwidth, GB/s"""
    memory_gib: float
    """memory torch can allocate on it (what `torch.cuda.mem_get_info` reports free on an idle device)"""
    nvlink_gbs: float
    """achieved NVLink bandwidth per GPU and direction, GB/s"""


GPUS: dict[str, Gpu] = {
    "h100": Gpu("H100 SXM 80GB", *GPU_PEAK_TFLOPS["H100"], 3350.0, 79.1, LINKS["NVLink4"].bandwidth / 1e9),
    "h200": Gpu("H200 SXM 141GB", *GPU_PEAK_TFLOPS["H200"], 4800.0, 139.8, LINKS["NVLink4"].bandwidth / 1e9),
    "b200": Gpu("B200 SXM 180GB", 2250.0, 80.0, 8000.0, 178.4, 720.0),
}
"""the GPUs `--gpu` names; every figure can be overridden (`--peak-tflops`, `--hbm-gbs`, `--memory-gib`)"""

LINK_CLASSES: dict[str, tuple[str, float, float]] = {
    "nvlink": ("NVLink (NVSwitch), the GPU's", 0.0, 3e-6),  # bandwidth: the GPU's nvlink_gbs
    "pcie4": ("PCIe Gen4 x16", LINKS["PCIe4"].bandwidth, LINKS["PCIe4"].alpha),
    "pcie5": ("PCIe Gen5 x16", LINKS["PCIe5"].bandwidth, LINKS["PCIe5"].alpha),
    "ib200": ("InfiniBand 200 Gbit/s", LINKS["IB200"].bandwidth, LINKS["IB200"].alpha),
    "ib400": ("InfiniBand 400 Gbit/s", LINKS["IB400"].bandwidth, LINKS["IB400"].alpha),
    "eth100": ("Ethernet 100 Gbit/s (RoCE)", 0.9 * gbit(100), 30e-6),
}
"""link class -> (name, achieved bytes/s per rank and direction, seconds per hop)"""

USABLE = 0.9
"""the share of a GPU's memory a plan may fill (allocator fragmentation, CUDA context, workspaces)"""
TP_CODECS = ("taco", "int8-hadamard", "int6-hadamard", "int4-hadamard")
"""the TP codecs every plan compares with plain traffic (plus the config's own)"""
DP_OVERLAP = 0.8
"""share of the DP gradient reduction hidden behind backward (as in `gpu_projection.step_time`)"""


@dataclass
class Hardware:
    gpu: Gpu
    links: dict[str, Link]
    """per axis (tp, pp, dp)"""
    mfu: float = MFU


def hardware(gpu: str, link: str, pp_link: str = "", dp_link: str = "", **over: float) -> Hardware:
    """The GPU and per-axis links, with overrides: peak_tflops, hbm_gbs, memory_gib, link_gbs
    (the TP link's bandwidth), link_us (its latency), mfu."""
    if gpu not in GPUS:
        raise ValueError(f"--gpu {gpu!r}: unknown GPU; choose one of {', '.join(GPUS)}")
    g = GPUS[gpu]
    changes = {
        k: v for k, v in (("hbm_gbs", over.get("hbm_gbs")), ("memory_gib", over.get("memory_gib"))) if v
    }
    if over.get("peak_tflops"):
        changes.update(bf16_tflops=over["peak_tflops"], fp32_tflops=over["peak_tflops"])
    g = dataclasses.replace(g, **changes)
    links = {}
    for axis, key in (("tp", link), ("pp", pp_link or link), ("dp", dp_link or link)):
        if key not in LINK_CLASSES:
            raise ValueError(f"--link {key!r}: unknown link class; choose one of {', '.join(LINK_CLASSES)}")
        name, bw, alpha = LINK_CLASSES[key]
        bw = bw or g.nvlink_gbs * 1e9
        if axis == "tp" and over.get("link_gbs"):
            bw = over["link_gbs"] * 1e9
        if axis == "tp" and over.get("link_us"):
            alpha = over["link_us"] * 1e-6
        links[axis] = Link(f"{key}: {name}", bw, alpha)
    return Hardware(g, links, over.get("mfu") or MFU)


def codec_cost(name: str, elem: int, gpu: Gpu) -> tuple[Any, CodecCost | None]:
    """(the codec, its cost on `gpu`): bytes per element from the codec itself; encode and decode
    memory-bound, each streaming input and wire bytes at CODEC_HBM_FRACTION of HBM bandwidth."""
    from taco.codec import build_codec

    codec = build_codec(name)
    if codec is None:
        return None, None
    import torch

    bpe = codec.nbytes(1 << 20, torch.bfloat16 if elem == 2 else torch.float32) / (1 << 20)
    rate = CODEC_HBM_FRACTION * gpu.hbm_gbs * 1e9 / (elem + bpe)
    return codec, CodecCost(name, bpe, rate, rate)


def _collective_numel(m: P.Msg, world: int) -> int:
    return m.numel * world if m.op == "all_gather" else m.numel  # the cost model: the gathered tensor


def traffic(cfg: Config, sh: P.Shapes, stage: int, codecs: dict[str, list[str]]) -> list[dict]:
    """Per axis and codec: bytes one rank of `stage` sends per step (raw, wire), TP recompute apart."""
    from taco.train.build import build_policy

    p = cfg.parallel
    elem = P.comm_elem(cfg)
    policy = build_policy(cfg)
    world = {"tp": p.tp, "pp": 2, "dp": p.dp}
    groups = {
        "tp": P.tp_messages(cfg, sh, stage),
        "tp recompute": P.recompute_messages(cfg, sh, stage, cfg.train.recompute.value),
        "pp": P.pp_messages(cfg, sh, stage),
        "dp": P.dp_messages(cfg, sh, stage),
    }
    rows = []
    for axis, msgs in groups.items():
        if not msgs:
            continue
        ax = axis.split()[0]
        e = 4 if ax == "dp" else elem
        for name in codecs[ax]:
            codec, _ = codec_cost(name, e, GPUS["h100"])
            raw = wire = 0
            for m in msgs:
                usable = codec if codec is not None and m.numel * e >= cfg.compression.min_bytes else None
                r, w = P.wire_bytes(
                    m.op, m.numel, e, world[ax], usable, policy.slices_for, policy.all_reduce_algo
                )
                raw, wire = raw + r * m.count, wire + w * m.count
            rows.append({"axis": axis, "codec": name, "raw_bytes": raw, "wire_bytes": wire})
    return rows


def step_time(cfg: Config, sh: P.Shapes, hw: Hardware, stage: int, tp_codec: str, mode: str) -> dict:
    """Seconds of one step on `stage` with `tp_codec` on the TP axis (PP and DP as configured)."""
    p = cfg.parallel
    b, s = P.micro_batch(cfg), cfg.model.seq_len
    elem = P.comm_elem(cfg)
    peak = (hw.gpu.bf16_tflops if cfg.train.dtype.value == "bf16" else hw.gpu.fp32_tflops) * 1e12
    flops = sh.flops_per_token * b * s / (p.tp * p.pp)
    attn_fwd = 4.0 * sh.layers * sh.heads * sh.head_dim * s * b * s / (p.tp * p.pp)  # scores and use
    if mode == "full":  # one more forward of the blocks
        head = 6.0 * sh.vocab * sh.hidden * b * s / (p.tp * p.pp)
        flops += (flops - head) / 3
    elif mode == "selective":  # the attention core and the output projection, forward
        flops += attn_fwd + 2.0 * sh.layers * sh.hidden * sh.heads * sh.head_dim * b * s / (p.tp * p.pp)
    compute = flops / (peak * hw.mfu)
    slices = cfg.compression.slices

    def coll(msgs: list[P.Msg], link: Link, world: int, codec: CodecCost | None, e: int) -> float:
        def one(m: P.Msg) -> float:
            return collective_time(m.op, _collective_numel(m, world), e, world, link, codec, slices).total_s

        return sum(m.count * one(m) for m in msgs)

    _, tcost = codec_cost(tp_codec, elem, hw.gpu)
    tp_msgs = P.tp_messages(cfg, sh, stage) + P.recompute_messages(cfg, sh, stage, mode)
    tp = coll(tp_msgs, hw.links["tp"], p.tp, tcost, elem) / p.microbatches
    _, pcost = codec_cost(cfg.compression.pp_codec, elem, hw.gpu)
    pp = coll(P.pp_messages(cfg, sh, stage), hw.links["pp"], 2, pcost, elem) / p.microbatches
    _, dcost = codec_cost(P.config_codec(cfg, "dp"), 4, hw.gpu)
    dp = (1 - DP_OVERLAP) * coll(P.dp_messages(cfg, sh, stage), hw.links["dp"], p.dp, dcost, 4)
    slot = compute + tp + pp
    total = slot * (p.microbatches + p.pp - 1) + dp
    m = p.microbatches
    return {"compute_s": compute * m, "tp_s": tp * m, "pp_s": pp * m, "dp_s": dp,
            "bubble_s": slot * (p.pp - 1), "total_s": total}  # fmt: skip


def data_vocab(cfg: Config) -> tuple[int, str]:
    """(the data's vocabulary, where it comes from): the prepared data set's, else data.vocab_size."""
    if cfg.model.vocab_size or cfg.model.init_from:
        return cfg.model.vocab_size, "model.vocab_size" if not cfg.model.init_from else "model.init_from"
    try:
        from taco.train.data import resolve_data_dir
        from taco.train.data.dataset import TokenDataset

        d = resolve_data_dir(cfg.data)
        return TokenDataset(d, "val", cfg.model.seq_len).vocab_size, f"the prepared data set {d}"
    except (FileNotFoundError, ValueError, OSError):
        return cfg.data.vocab_size, "data.vocab_size (no prepared data set found)"


def make_plan(cfg: Config, hw: Hardware, codecs: list[str] | None = None) -> dict:
    """Everything `taco plan` prints, as plain data (its `--json`)."""
    vocab, vocab_src = data_vocab(cfg)
    sh = P.build_shapes(cfg, vocab)
    p, mode = cfg.parallel, cfg.train.recompute.value
    mems = P.memory(cfg, sh)
    usable = hw.gpu.memory_gib * GiB * USABLE
    busiest = max(range(p.pp), key=lambda st: mems[st].total(mode))
    tp_list = list(dict.fromkeys(["none", cfg.compression.tp_codec, *(codecs or TP_CODECS)]))
    if p.tp == 1:
        tp_list = ["none"]
    per_axis = {"tp": tp_list, "pp": list(dict.fromkeys(["none", cfg.compression.pp_codec])),
                "dp": list(dict.fromkeys(["none", P.config_codec(cfg, "dp")]))}  # fmt: skip
    times = {c: step_time(cfg, sh, hw, busiest, c, mode) for c in tp_list}
    base = times["none"]["total_s"]
    return {
        "model": {"kind": sh.kind, "preset": cfg.model.preset, "params": sh.params_total, "layers": sh.layers,
                  "hidden": sh.hidden, "heads": sh.heads, "kv_heads": sh.kv_heads, "ffn": sh.ffn,
                  "vocab": sh.vocab, "vocab_from": vocab_src, "seq_len": cfg.model.seq_len},
        "mesh": str(p), "micro_batch": P.micro_batch(cfg), "microbatches": p.microbatches,
        "recompute": mode, "dtype": cfg.train.dtype.value, "recipe": P.recipe(cfg),
        "state_bytes": dict(zip(("params", "grads", "masters"), P.state_bytes(cfg))),
        "gpu": dataclasses.asdict(hw.gpu), "mfu": hw.mfu,
        "links": {a: {"name": x.name, "bytes_per_s": x.bandwidth, "alpha_s": x.alpha}
                  for a, x in hw.links.items()},
        "usable_bytes": usable, "busiest_stage": busiest,
        "memory": [dict(dataclasses.asdict(m), total={k: m.total(k) for k in P.MODES}) for m in mems],
        "traffic": traffic(cfg, sh, busiest, per_axis),
        "step": {c: {**t, "speedup": base / t["total_s"]} for c, t in times.items()},
        "fits": mems[busiest].total(mode) <= usable,
    }  # fmt: skip


def fixes(cfg: Config, plan: dict) -> list[str]:
    """What to change when the plan does not fit: each suggestion checked with the same model."""
    usable = plan["usable_bytes"]
    mem = plan["memory"][plan["busiest_stage"]]
    out = [f"train.recompute={m} ({mem['total'][m] / GiB:.1f} GiB)" for m in ("selective", "full")
           if m != plan["recompute"] and mem["total"][m] <= usable]  # fmt: skip
    p = cfg.parallel
    b = P.micro_batch(cfg)
    if b > 1:
        out.append(f"parallel.microbatches={p.microbatches * 2} (micro-batch {b} -> {b // 2} sequences: "
                   "activations halve)")  # fmt: skip
    if not p.zero and not p.dp_shard and p.dp > 1:
        out.append("parallel.zero=true or parallel.dp_shard=true (optimizer state, and with dp_shard weights "
                   "and gradients, over dp)")  # fmt: skip
    out.append(f"parallel.pp={p.pp * 2} or parallel.tp={p.tp * 2} (weights and activations over more GPUs), "
               "or a GPU with more memory (--gpu h200/b200)")  # fmt: skip
    return out


def _gib(x: float) -> str:
    return f"{x / GiB:8.2f}"


def format_plan(plan: dict) -> str:
    """The terminal table of `make_plan`."""
    md, g = plan["model"], plan["gpu"]
    lines = [
        f"taco plan: {md['preset'] or md['kind']} ({md['kind']} family), {md['params'] / 1e9:.3f}B "
        f"parameters, {md['layers']} layers, hidden {md['hidden']}, vocab {md['vocab']}; "
        f"mesh {plan['mesh']}, micro-batch "
        f"{plan['micro_batch']} x {md['seq_len']} tokens x {plan['microbatches']} per step, {plan['dtype']}, "
        f"recompute={plan['recompute']}",
        f"GPU {g['name']}: {g['memory_gib']:.1f} GiB ({USABLE:.0%} usable: "
        f"{plan['usable_bytes'] / GiB:.1f} GiB); links: "
        + "; ".join(f"{a.upper()} {x['name']} {x['bytes_per_s'] / 1e9:.1f} GB/s"
                    for a, x in plan["links"].items()),
        "",
        f"Memory per GPU, GiB (stage {plan['busiest_stage']}, the busiest; per stage in --json)",
    ]  # fmt: skip
    m, sb = plan["memory"][plan["busiest_stage"]], plan["state_bytes"]
    dt = {2: "bf16", 4: "fp32"}
    rows = {
        f"parameters ({dt[sb['params']]})": m["params"],
        f"gradients ({dt[sb['grads']]})": m["grads"],
        "optimizer + masters" if sb["masters"] else "optimizer (AdamW)": m["optimizer"],
        "comm buffers": m["buffers"],
    }
    lines += [f"  {label:<21} {_gib(v)}" for label, v in rows.items()]
    for mode in P.MODES:
        mark = "  <- train.recompute" if mode == plan["recompute"] else ""
        lines.append(
            f"  activations {mode:<9} {_gib(m['activations'][mode])}   total {_gib(m['total'][mode])}{mark}"
        )
    lines += [
        "",
        "Traffic per step per GPU, MiB (raw = uncompressed in the comm dtype; wire = through the codec)",
    ]
    if plan["mesh"].endswith("-SP"):
        lines.append("  (sequence parallel: the TP rows are the SP all-gathers and reduce-scatters)")
    lines.append(f"  {'axis':<13} {'codec':<16} {'raw':>10} {'wire':>10} {'ratio':>6}")
    for r in plan["traffic"]:
        ratio = r["raw_bytes"] / r["wire_bytes"] if r["wire_bytes"] else 1.0
        lines.append(f"  {r['axis']:<13} {r['codec']:<16} {r['raw_bytes'] / 2**20:>10.1f} "
                     f"{r['wire_bytes'] / 2**20:>10.1f} {ratio:>5.2f}x")  # fmt: skip
    lines += ["", "Predicted step time per TP codec (cost model), ms"]
    lines.append(f"  {'TP codec':<16} {'compute':>9} {'TP':>9} {'PP':>8} {'DP':>8} {'bubble':>8} {'step':>9} "
                 f"{'speedup':>8}")  # fmt: skip
    for c, t in plan["step"].items():
        lines.append(f"  {c:<16} {t['compute_s'] * 1e3:>9.1f} {t['tp_s'] * 1e3:>9.1f} "
                     f"{t['pp_s'] * 1e3:>8.1f} "
                     f"{t['dp_s'] * 1e3:>8.1f} {t['bubble_s'] * 1e3:>8.1f} {t['total_s'] * 1e3:>9.1f} "
                     f"{t['speedup']:>7.2f}x")  # fmt: skip
    lines += ["", "Assumptions:", *assumptions(plan)]
    return "\n".join(lines)


def recipe_text(plan: dict) -> str:
    """The `train.mixed_precision` recipe (or fp32) as the plan's assumptions name it."""
    sb = plan["state_bytes"]
    if plan["recipe"] == "fp32":
        return "fp32 weights, gradients and activations"
    if plan["recipe"] == "autocast":
        return "bf16 autocast over fp32 weights and gradients (fp32 residual stream and norms)"
    if not sb["masters"]:
        return "FSDP2 mixed precision: fp32 shards, bf16 gathered weights and activations"
    grads = "gradients bf16" if sb["grads"] == 2 else "micro-batch gradients summed in fp32"
    return f"bf16 weights and activations, {grads}, fp32 master weights in the optimizer"


def assumptions(plan: dict) -> list[str]:
    g = plan["gpu"]
    return [
        f"- compute: {g['bf16_tflops']:g} (bf16) / {g['fp32_tflops']:g} (fp32) TFLOP/s dense peak x MFU "
        f"{plan['mfu']:g}; 6 N + 12 L d T FLOPs per token; recompute adds the blocks' forward (full) or the "
        "attention core and output projection (selective)",
        f"- codecs on the GPU: memory-bound, encode and decode each stream input + wire bytes at "
        f"{CODEC_HBM_FRACTION:.0%} of {g['hbm_gbs']:g} GB/s HBM; bytes per element from the codec itself",
        "- collectives: alpha-beta per hop, plain all-reduce = ring, compressed = two-shot (gather on two "
        "ranks), coding and wire overlapped over compression.slices; not overlapped with compute",
        f"- pipeline: 1F1B, (pp - 1) bubble slots; DP gradient reduction {DP_OVERLAP:.0%} hidden behind "
        "backward",
        f"- memory: {recipe_text(plan)}; AdamW 2 fp32 states; activations counted per block as "
        "autograd saves them on a CPU; buffers: compressed TP cache 4 x the largest message, DDP "
        f"buckets, FSDP one gathered block; {USABLE:.0%} of the GPU usable",
        f"- the vocabulary: {plan['model']['vocab_from']}; TP traffic as taco.comm counts it per step "
        "(the CE's and the partial-gradient sums' small plain all-reduces not included)",
    ]


def add_plan_subparser(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="per-GPU memory, traffic per link and predicted speedup of each codec, before a launch",
        description="Plan a run without starting it: per GPU the bytes of parameters, gradients, optimizer "
        "state, activations for each train.recompute mode and communication buffers; per step and axis the "
        "traffic with and without each codec; the step time and speedup of each TP codec from the cost "
        "model, with its assumptions. Exits 2, naming what to change, when the layout does not fit. "
        "Extra --section.key=value arguments (or --set section.key=value) override the config.",
    )
    p.add_argument("--config", default=None, help="TOML config (e.g. configs/demo.toml)")
    p.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="a config override"
    )
    p.add_argument("--gpu", default="h100", choices=sorted(GPUS), help="the GPU (default h100)")
    p.add_argument(
        "--link", default="nvlink", choices=list(LINK_CLASSES), help="TP link class (default nvlink)"
    )
    p.add_argument(
        "--pp-link", default="", choices=["", *LINK_CLASSES], help="PP link class (default --link)"
    )
    p.add_argument(
        "--dp-link", default="", choices=["", *LINK_CLASSES], help="DP link class (default --link)"
    )
    p.add_argument("--codecs", default=",".join(TP_CODECS), help="TP codecs to compare (comma list)")
    for name, what in (
        ("peak-tflops", "dense TFLOP/s in train.dtype"),
        ("hbm-gbs", "HBM GB/s"),
        ("memory-gib", "GPU memory, GiB"),
        ("link-gbs", "TP link GB/s per direction"),
        ("link-us", "TP link latency per hop, us"),
        ("mfu", "fraction of peak reached"),
    ):
        p.add_argument(f"--{name}", type=float, default=0.0, help=f"override the table: {what}")  # fmt: skip
    p.add_argument(
        "--json", default=None, metavar="PATH", help="also write the plan as JSON ('-': stdout only)"
    )
    p.set_defaults(func=run_plan, takes_overrides=True)


def run_plan(args: Any) -> int:
    import json
    import sys

    from taco.train.config import load_config

    try:
        overrides = [*(f"--{s}" for s in args.set), *args.overrides]
        cfg = load_config(args.config, overrides)
        from taco.train.finetune import resolve_init_from

        notes = resolve_init_from(cfg)  # a checkpoint decides the sizes, as for `taco train`
        over = {
            k: getattr(args, k)
            for k in ("peak_tflops", "hbm_gbs", "memory_gib", "link_gbs", "link_us", "mfu")
        }
        hw = hardware(args.gpu, args.link, args.pp_link, args.dp_link, **over)
        plan = make_plan(cfg, hw, [c for c in args.codecs.split(",") if c])
    except (ValueError, FileNotFoundError) as e:
        print(f"taco plan: {e}", file=sys.stderr)
        return 2
    if args.json == "-":
        print(json.dumps(plan, indent=2))
    else:
        print("\n".join([*notes, format_plan(plan)]))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(plan, f, indent=2)
            print(f"wrote {args.json}")
    if not plan["fits"]:
        m = plan["memory"][plan["busiest_stage"]]
        print(f"taco plan: does not fit: stage {plan['busiest_stage']} needs "
              f"{m['total'][plan['recompute']] / GiB:.1f} GiB per GPU with "
              f"train.recompute={plan['recompute']}, "
              f"{plan['usable_bytes'] / GiB:.1f} GiB usable on {plan['gpu']['name']}. Change one of: "
              + "; ".join(fixes(cfg, plan)), file=sys.stderr)  # fmt: skip
        return 2
    return 0
