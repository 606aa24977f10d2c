"""`taco bench cluster`: end-to-end training speed on a bandwidth-limited emulated network (DESIGN.md 3).

Why this file exists: on one machine ranks talk at memory speed, so only an emulated slow link
shows what TP compression buys a whole training step. This runs the same short training job
(config + overrides, e.g. a tiny GPT with TP=2) with the uncompressed baseline and each codec,
all ranks inside a network namespace whose `lo` is capped by `tc` (`netns.py`), one compute
thread per rank, at each rate of `--rates`. It reports tokens/s, the measured communication
share f of a baseline step, the wire ratio r (raw / wire bytes), the speedup, the ideal speedup
1 / (1 - f + f / r), the achieved fraction of it, the loss gap, and the step time the cost model
(`cost_model.py`) predicts from uncapped measurements and a probe of the capped link.

    python -m taco.bench.cluster --rates 50,100,200,400,1000 --codecs taco --json out.json
    taco bench cluster --set train.steps=20 --comm bf16,fp32 --plot docs/cluster_speedup.png

Communication dtype (`--comm`), each mode with its own baseline:
- bf16: `train.dtype=bf16` and every TP collective in bf16 (`parallel.tp_comm_dtype` "auto"/"bf16",
  as Megatron communicates in bf16 training). Without the cast, autocast would leave the backward
  TP all-reduces (the gradients of the fp32 residual stream) in fp32.
- autocast: `train.dtype=bf16`, `parallel.tp_comm_dtype=input`: whatever autocast leaves (mixed).
- fp32: `train.dtype=fp32`, fp32 on the wire.
The `tc` token bucket uses a small burst (32 KiB, lo MTU lowered to 16 KiB to allow it), so that
idle time banks little (3% of a 1 MiB TP all-reduce): the link behaves as a plain rate limit.
Each link (and the uncapped lo) is measured: bandwidth by a bulk TCP stream (the model's), and for
the record the time of a plain 1 KiB and one TP-sized all-reduce. Needs root; without it this
says so and exits with status 2. The namespace is always deleted.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from . import cli_entry
from . import cost_model as cm
from .codec import best_time
from .netns import ROOT, child_env, require_root
from .ranks import comma_list as _csv
from .ranks import gloo_rank, spawn_ranks

MODES = {
    "bf16": "train.dtype=bf16, parallel.tp_comm_dtype=bf16: every TP collective in bf16 (Megatron)",
    "autocast": "train.dtype=bf16, parallel.tp_comm_dtype=input: as autocast leaves it (fwd bf16, bwd fp32)",
    "fp32": "train.dtype=fp32, fp32 on the wire",
}
MODE_DTYPES = {"bf16": ("bf16", "bf16"), "autocast": ("bf16", "input"), "fp32": ("fp32", "fp32")}
PHASES = ("comm_s", "encode_s", "decode_s")


def add_cluster_subparser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `cluster` on a subparsers object (`taco bench cluster ...`)."""
    p = subparsers.add_parser(
        "cluster", help="end-to-end training on a tc-capped emulated link", description=__doc__.split("\n")[0]
    )
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=str(ROOT / "configs" / "cluster.toml"), help="training config TOML")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="config override")
    p.add_argument("--rates", type=_csv(float), default=[50, 100, 200, 400, 1000], help="lo caps, Mbit/s")
    p.add_argument("--codecs", type=_csv(str), default=["taco"], help="codecs; the baseline always runs")
    p.add_argument("--comm", type=_csv(str), default=["bf16", "fp32"], help=f"modes: {', '.join(MODES)}")
    p.add_argument("--warmup", type=int, default=None, help="first steps left out of the timing (3)")
    p.add_argument("--threads", type=int, default=1, help="compute threads per rank")
    p.add_argument("--backend", choices=("auto", "eager"), default="auto", help="auto: import taco.kernels")
    p.add_argument("--burst", default="32kb", help="tc tbf burst")
    p.add_argument("--latency", default="400ms", help="tc tbf latency (queue bound, not a delay)")
    p.add_argument("--delay", type=float, default=0.0, help="netem one-way delay in ms (needs sch_netem)")
    p.add_argument("--mtu", type=int, default=16384, help="lo MTU in the namespace (must fit in the burst)")
    p.add_argument("--uncapped", choices=("both", "first", "none"), default="both",
                   help="uncapped reference runs before and after the capped ones (averaged), before, "
                        "or none (then no f_cap and no model)")  # fmt: skip
    p.add_argument("--model-codec", choices=("inplace", "microbench"), default="inplace",
                   help="model codec cost: from the uncapped training run, or a microbenchmark")  # fmt: skip
    p.add_argument("--timeout", type=float, default=7200, help="seconds allowed per link rate")
    p.add_argument("--json", default=None, metavar="PATH", help="write runs, rows and validation as JSON")
    p.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="speedup vs bandwidth (and PNG_model.png: modeled vs measured)",
    )
    p.add_argument("--markdown", default=None, metavar="PATH", help="write the capped rows as markdown")
    p.add_argument("--from-json", default=None, metavar="PATH", help="re-analyse a --json file, no runs")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # re-executed inside the netns


# ----------------------------------------------------------------------------- inside a rank


def _train(cfg: Any, data_dir: Path) -> dict[str, Any]:
    """The training loop of one rank; per-step TP bytes and phase times from the TP policy's stats."""
    from taco.parallel import ParallelDims
    from taco.train.trainer import Trainer

    p = cfg.parallel
    tr = Trainer(cfg, ParallelDims(dp=p.dp, pp=p.pp, tp=p.tp, sp=p.sp).build(), data_dir, False)
    stats = tr.policy.stats
    keys = ("wire_bytes", "raw_bytes", *PHASES)
    steps = []
    while tr.step < cfg.train.steps:
        before = stats.total()
        st = tr.train_step()
        after = stats.total()
        delta = {k: getattr(after, k) - getattr(before, k) for k in keys}
        steps.append(dict(step_s=st.seconds, loss=st.loss, **delta))
    sites = {
        n: dict(calls=s.calls, raw_bytes=s.raw_bytes, wire_bytes=s.wire_bytes) for n, s in stats.sites.items()
    }
    return dict(steps=steps, val_loss=tr.evaluate(), sites=sites)


def _rank_main(rank: int, world: int, port: int, spec: dict[str, Any]) -> dict[str, Any]:
    from taco.train.config import Config

    if spec["backend"] == "auto":
        import taco.kernels  # noqa: F401 - registers the native CPU codec kernels
    with gloo_rank(rank, world, port, spec["threads"], spec["timeout"]):
        return _train(Config.from_dict(spec["config"]), Path(spec["data_dir"]))


# ----------------------------------------------------------------------------- the worker (in the netns)


def probe_link(rate_mbit: float | None) -> dict[str, float]:
    """Payload bytes/s of one TCP stream over this namespace's lo, and the 1-byte round trip."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    seconds = 0.5 if rate_mbit else 0.2
    total = int(min(max((rate_mbit or 8000) * 1e6 / 8 * seconds, 1 << 20), 1 << 30))

    def serve() -> None:
        c, _ = srv.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(21):
            c.sendall(c.recv(1))
        got = 0
        while got < total:
            got += len(c.recv(1 << 20))
        c.sendall(b"k")
        c.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    s = socket.create_connection(srv.getsockname())
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(21):
        t0 = time.perf_counter()
        s.sendall(b"p")
        s.recv(1)
        rtts.append(time.perf_counter() - t0)
    buf = bytes(1 << 20)
    t0 = time.perf_counter()
    sent = 0
    while sent < total:
        n = min(len(buf), total - sent)
        s.sendall(buf[:n])
        sent += n
    s.recv(1)
    dt = time.perf_counter() - t0
    s.close()
    srv.close()
    return dict(bytes_per_s=total / dt, rtt_s=statistics.median(rtts[1:]), probe_bytes=total)


def _calib_rank(rank: int, world: int, port: int, numel: int, gap_s: float) -> dict[str, float]:
    """Time plain gloo all-reduces of 1 KiB and of one TP message (bf16), `gap_s` idle before each."""
    import torch.distributed as dist

    res = {}
    with gloo_rank(rank, world, port, 1, 600):
        for name, x, reps in (
            ("small", torch.zeros(256), 21),
            ("big", torch.zeros(numel, dtype=torch.bfloat16), 9),
        ):
            dist.all_reduce(x)
            ts = []
            for _ in range(reps):
                dist.barrier()
                time.sleep(gap_s)  # as between TP collectives in training: the token bucket refills
                t0 = time.perf_counter()
                dist.all_reduce(x)
                ts.append(time.perf_counter() - t0)
            res[f"{name}_s"], res[f"{name}_bytes"] = statistics.median(ts), x.numel() * x.element_size()
    return res


def calibrate_link(world: int, numel: int, gap_s: float = 0.02) -> dict[str, float]:
    """Latency of this namespace's lo as a plain all-reduce sees it: alpha = the median time of a
    1 KiB all-reduce (a TP-sized one is timed too, for the record; bandwidth is the TCP probe's)."""
    res = spawn_ranks(_calib_rank, world, numel, gap_s)
    res["alpha_s"] = res["small_s"]
    return res


def _worker(job_path: str) -> int:
    """Run every job of a job file (one link rate) and write the records next to it."""
    job = json.loads(Path(job_path).read_text())
    spec0 = job["runs"][0]["config"]
    world = spec0["parallel"]["dp"] * spec0["parallel"]["pp"] * spec0["parallel"]["tp"]
    numel = spec0["train"]["batch_size"] * spec0["model"]["seq_len"] * spec0["model"]["hidden"]
    out = {"rate_mbit": job["rate_mbit"], "probe": probe_link(job["rate_mbit"]),
           "calib": calibrate_link(world, numel), "runs": []}  # fmt: skip
    link = f"{job['rate_mbit']:g} Mbit/s" if job["rate_mbit"] else "uncapped"
    for spec in job["runs"]:
        cfg = spec["config"]
        world = cfg["parallel"]["dp"] * cfg["parallel"]["pp"] * cfg["parallel"]["tp"]
        load0 = os.getloadavg()[0]
        rec = spawn_ranks(_rank_main, world, spec)
        rec.update(
            mode=spec["mode"],
            codec=spec["codec"],
            rate_mbit=job["rate_mbit"],
            world=world,
            loadavg=[load0, os.getloadavg()[0]],
        )  # 1-min load: ~world when the box is ours
        out["runs"].append(rec)
        Path(job["out"]).write_text(json.dumps(out))
        s = summarize(rec, spec["warmup"], 1)
        print(f"[cluster] {link:>12} {spec['mode']:<8} {spec['codec']:<14} {s['step_s'] * 1e3:9.1f} ms/step "
              f"comm {s['comm_s'] * 1e3:8.1f} ms  val {rec['val_loss']:.4f}  load {s['load']:.1f}",
              flush=True)  # fmt: skip
    Path(job["out"]).write_text(json.dumps(out))
    return 0


# ----------------------------------------------------------------------------- the parent


def plan_runs(cfg: Any, args: argparse.Namespace, data_dir: Path) -> list[dict[str, Any]]:
    """One spec per (comm mode, codec): the baseline "none" first in each mode."""
    from taco.codec import accepted_options

    bad = [m for m in args.comm if m not in MODES]
    if bad:
        raise ValueError(f"unknown --comm modes {bad}: choose from {', '.join(MODES)}")
    specs = []
    for mode in args.comm:
        for codec in ["none", *[c for c in args.codecs if c != "none"]]:
            c = copy.deepcopy(cfg)
            dtype, comm_dtype = MODE_DTYPES[mode]
            c.train.dtype = type(c.train.dtype).parse(dtype, "train.dtype")
            choice = type(c.parallel.tp_comm_dtype)
            c.parallel.tp_comm_dtype = choice.parse(comm_dtype, "parallel.tp_comm_dtype")
            c.compression.tp_codec = codec
            c.compression.tp_codec_options = accepted_options(codec, cfg.compression.tp_codec_options)
            c.train.resume = False
            c.train.out_dir = str(Path(tempfile.gettempdir()) / "taco-cluster")
            specs.append(dict(mode=mode, codec=codec, config=c.to_dict(), data_dir=str(data_dir),
                              threads=args.threads, backend=args.backend, warmup=args.warmup,
                              timeout=min(args.timeout, 1800)))  # fmt: skip
    return specs


def _run_worker(argv: list[str], timeout: float) -> int:
    """Run the worker in its own process group; kill that group if anything goes wrong."""
    proc = subprocess.Popen(argv, env=child_env(), start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def execute(rate: float | None, specs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """All runs at one link rate (None: the host's uncapped lo); the worker's records."""
    from .netns import NetNamespace

    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.json"
        out = Path(tmp) / "out.json"
        job.write_text(json.dumps(dict(rate_mbit=rate, runs=specs, out=str(out))))
        argv = [sys.executable, "-m", "taco.bench.cluster", "--worker", str(job)]
        if rate is None:
            print("[cluster] link: host lo, uncapped", flush=True)
            code = _run_worker(argv, args.timeout)
        else:
            with NetNamespace(rate, args.burst, args.latency, args.delay) as ns:
                subprocess.run(
                    ["ip", "-n", ns.name, "link", "set", "dev", "lo", "mtu", str(args.mtu)], check=True
                )
                print(f"[cluster] {ns.describe()}, lo mtu {args.mtu}", flush=True)
                code = _run_worker(ns.command(argv), args.timeout)
                qdisc = ns.qdisc_stats()
        if code:
            raise RuntimeError(f"cluster worker at rate {rate} failed with status {code}")
        res = json.loads(out.read_text())
    if rate is not None:
        res["qdisc"] = qdisc
    return res


def codec_rates(codecs: list[str], numel: int, threads: int, backend: str) -> dict[str, dict[str, float]]:
    """Elements/s of encode and decode per (codec, input dtype) at the TP message size, in place."""
    from taco.comm import make_codec

    if backend == "auto":
        import taco.kernels  # noqa: F401
    torch.set_num_threads(threads)
    out: dict[str, dict[str, float]] = {}
    for spec in codecs:
        codec = make_codec(spec)
        if codec is None:
            continue
        for dt_name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            x = torch.randn(numel).to(dt)
            p = codec.encode(x)
            codec.decode(p)
            enc = best_time(lambda c=codec, x=x, p=p: c.encode(x, out=p.data), 7, x.device)
            dec = best_time(lambda c=codec, p=p: c.decode(p), 7, x.device)
            out[f"{spec}/{dt_name}"] = dict(encode=numel / enc, decode=numel / dec,
                                            bytes_per_elem=codec.nbytes(numel, dt) / numel)  # fmt: skip
    return out


# ----------------------------------------------------------------------------- analysis


def summarize(rec: dict[str, Any], warmup: int, tokens_per_step: int) -> dict[str, float]:
    """Means over the timed steps (after `warmup`) of one run record."""
    steps = rec["steps"][warmup:] or rec["steps"]
    mean = {k: statistics.fmean(s[k] for s in steps) for k in ("step_s", "wire_bytes", "raw_bytes", *PHASES)}
    losses = [s["loss"] for s in rec["steps"]]
    return dict(mean, tokens_per_s=tokens_per_step / mean["step_s"], val_loss=rec["val_loss"],
                train_loss=statistics.fmean(losses[-5:]), timed_steps=len(steps),
                load=max(rec.get("loadavg") or [float("nan")]))  # fmt: skip


def wire_dtype_check(rec: dict[str, Any], numel: int) -> dict[str, float]:
    """Bytes per element of the forward and backward TP sites of a plain run (2: bf16, 4: fp32)."""
    n = rec["world"]
    out = {}
    for direction in ("fwd", "bwd"):
        sites = [s for name, s in rec["sites"].items() if name.endswith("." + direction) and s["calls"]]
        calls = sum(s["calls"] for s in sites)
        raw = sum(s["raw_bytes"] for s in sites)
        out[direction] = raw / (calls * numel * 2 * (n - 1) / n) if calls else float("nan")
    return out


def messages(rec: dict[str, Any], numel: int) -> list[cm.Message]:
    """The TP all-reduces of one step of a plain run, with their measured bytes per element."""
    n, steps = rec["world"], len(rec["steps"])
    msgs = []
    for s in rec["sites"].values():
        per_call = s["raw_bytes"] / s["calls"]
        elem = per_call / (numel * 2 * (n - 1) / n)
        msgs += [cm.Message("all_reduce", numel, round(elem))] * round(s["calls"] / steps)
    return msgs


def _codec_costs(rates: dict[str, dict[str, float]], codec: str) -> dict[float, cm.CodecCost]:
    """Microbenchmarked coding cost per input dtype (2: bf16, 4: fp32 bytes per element)."""
    out = {}
    for dt_name, elem in (("bf16", 2.0), ("fp32", 4.0)):
        r = rates.get(f"{codec}/{dt_name}")
        if r:
            out[elem] = cm.CodecCost(codec, r["bytes_per_elem"], r["encode"], r["decode"])
    return out


def inplace_codec_cost(rec: dict[str, Any], msgs: list[cm.Message], warmup: int) -> cm.CodecCost:
    """The codec as measured inside an (uncapped) training run: elements coded per second of
    encode_s / decode_s, and wire bytes per element, over the step's all-reduces (two-shot counts)."""
    s, n = summarize(rec, warmup, 1), rec["world"]
    elems = sum(m.numel for m in msgs)
    return cm.CodecCost(
        rec["codec"],
        bytes_per_elem=s["wire_bytes"] / (2 * (n - 1) / n * elems),
        encode_rate=elems / max(s["encode_s"], 1e-12),
        decode_rate=(2 * n - 1) / n * elems / max(s["decode_s"], 1e-12),
    )


def tc_bytes(size: str) -> float:
    """A tc size ("32kb", "1mb", "256kbit", "1500") in bytes (tc: k = 1024)."""
    t = size.strip().lower()
    units = {"kbit": 128, "mbit": 131072, "bit": 0.125, "kb": 1024, "k": 1024, "mb": 1 << 20, "m": 1 << 20,
             "gb": 1 << 30, "g": 1 << 30, "b": 1}  # fmt: skip
    for unit, mult in units.items():
        if t.endswith(unit):
            return float(t[: -len(unit)]) * mult
    return float(t)


def link_of(res: dict[str, Any], burst: str, delay_ms: float = 0.0) -> cm.Link:
    """The emulated link of one rate as the model sees it: bandwidth = the TCP bulk probe, the tc
    token bucket's burst and the netem delay per hop (none on the uncapped lo); the uncapped lo's
    latency is part of each run's measured `wait`."""
    capped = res["rate_mbit"] is not None
    return cm.Link("emulated lo" if capped else "lo", res["probe"]["bytes_per_s"],
                   delay_ms / 1e3 if capped else 0.0, shared=True,
                   burst=tc_bytes(burst) if capped else 0.0)  # fmt: skip


def _wait(rec: dict[str, Any], msgs: list[cm.Message], link: cm.Link, warmup: int) -> float:
    """Seconds per TP collective of an uncapped run beyond its bytes on the uncapped lo: latency plus
    the ranks waiting for each other (compute skew on a shared CPU)."""
    s, n = summarize(rec, warmup, 1), rec["world"]
    per_rank = s["wire_bytes"] / len(msgs)
    return max(0.0, s["comm_s"] / len(msgs) - link.transfer(per_rank, n, 0))


def model_inputs(unc: dict[str, Any], mode: str, numel: int, args: argparse.Namespace) -> dict[str, Any]:
    """What the model takes from the uncapped runs of one mode: compute seconds (baseline step minus
    its TP communication), the step's TP messages, each codec's in-place cost, and per run (baseline
    and codecs) the per-collective `wait` that bytes in flight can hide on a slower link."""
    base = unc["runs"][(mode, "none")]
    s = summarize(base, args.warmup, 1)
    msgs = messages(base, numel)
    link = link_of(unc, args.burst)
    present = dict.fromkeys(c for c in ["none", *args.codecs] if (mode, c) in unc["runs"])
    runs = {c: unc["runs"][(mode, c)] for c in present}
    codecs = {c: inplace_codec_cost(r, msgs, args.warmup) for c, r in runs.items() if c != "none"}
    waits = {c: _wait(r, msgs, link, args.warmup) for c, r in runs.items()}
    return dict(compute_s=s["step_s"] - s["comm_s"], messages=msgs, world=base["world"], codecs=codecs,
                wait_s=waits)  # fmt: skip


def predict(inp: dict[str, Any], link: cm.Link, codec: str, costs: Any, slices: int) -> float:
    """Modeled step seconds of run `codec`: the baseline's measured compute + every TP collective on
    `link` with that run's measured `wait`, coding (`costs`) included for a codec."""
    link = dataclasses.replace(link, wait=inp["wait_s"].get(codec, inp["wait_s"]["none"]))
    msgs = inp["messages"]
    return cm.step_time_measured_compute(inp["compute_s"], msgs, inp["world"], link, costs, slices)[0]


def _model_codec(inp: dict[str, Any], rates: dict, codec: str, source: str) -> Any:
    if codec == "none":
        return None
    return inp["codecs"].get(codec) if source == "inplace" else _codec_costs(rates, codec)


def _gap(s: dict[str, float], base: dict[str, float], key: str) -> float:
    return 100 * (s[key] - base[key]) / base[key]


def curve_gap(rec: dict[str, Any], base: dict[str, Any]) -> dict[str, float]:
    """Per-step relative training-loss difference to the baseline (same batches): mean and max |.|, %."""
    d = [100 * (a["loss"] - b["loss"]) / b["loss"] for a, b in zip(rec["steps"], base["steps"])]
    return dict(curve_gap_pct=statistics.fmean(d), curve_max_pct=max(abs(x) for x in d))


def merge_uncapped(results: list[dict[str, Any]], warmup: int) -> list[dict[str, Any]]:
    """One uncapped entry first: repeated uncapped sets pooled run by run (timed steps concatenated)."""
    sets = [r for r in results if r["rate_mbit"] is None]
    rest = [r for r in results if r["rate_mbit"] is not None]
    if len(sets) <= 1:
        return sets + rest
    runs = []
    for first in sets[0]["runs"]:
        same = [
            r for s in sets for r in s["runs"] if (r["mode"], r["codec"]) == (first["mode"], first["codec"])
        ]
        steps = first["steps"] + [st for r in same[1:] for st in r["steps"][warmup:]]
        sites = {n: {k: sum(r["sites"][n][k] for r in same) for k in v} for n, v in first["sites"].items()}
        loads = [x for r in same for x in r.get("loadavg", [])]
        runs.append(dict(first, steps=steps, sites=sites, loadavg=loads, repeats=len(same)))

    def mean(key: str) -> dict[str, float]:
        return {k: statistics.fmean(s[key][k] for s in sets) for k in sets[0][key]}

    return [dict(rate_mbit=None, probe=mean("probe"), calib=mean("calib"), runs=runs), *rest]


def analyse(results: list[dict[str, Any]], cfg: Any, args: argparse.Namespace, rates: dict) -> dict[str, Any]:
    """Rows of the report (one per mode x link x codec), dtype checks and model inputs per mode."""
    results = merge_uncapped(results, args.warmup)
    tokens = cfg.train.batch_size * cfg.model.seq_len
    numel = tokens * cfg.model.hidden
    slices = cfg.compression.slices
    runs = {(r["mode"], r["rate_mbit"], r["codec"]): r for res in results for r in res["runs"]}
    rows, checks, inputs = [], {}, {}
    for mode in args.comm:
        unc = next((r for r in results if r["rate_mbit"] is None), None)
        if unc is not None and (mode, None, "none") in runs:
            checks[mode] = wire_dtype_check(runs[(mode, None, "none")], numel)
            unc_runs = {(r["mode"], r["codec"]): r for r in unc["runs"]}
            inputs[mode] = model_inputs(dict(unc, runs=unc_runs), mode, numel, args)
        for res in results:
            rate = res["rate_mbit"]
            base_rec = runs.get((mode, rate, "none"))
            if base_rec is None:
                continue
            base = summarize(base_rec, args.warmup, tokens)
            f = base["comm_s"] / base["step_s"]
            f_cap = 1 - inputs[mode]["compute_s"] / base["step_s"] if mode in inputs else float("nan")
            for codec in ["none", *args.codecs]:
                rec = runs.get((mode, rate, codec))
                if rec is None or (codec == "none" and codec in args.codecs):
                    continue
                s = summarize(rec, args.warmup, tokens)
                r = base["wire_bytes"] / s["wire_bytes"] if s["wire_bytes"] else 1.0
                row = dict(mode=mode, rate_mbit=rate, codec=codec, **s, f=f, f_cap=f_cap, r=r,
                           speedup=base["step_s"] / s["step_s"], ideal=cm.ideal_speedup(f, r),
                           val_gap_pct=_gap(s, base, "val_loss"),
                           train_gap_pct=_gap(s, base, "train_loss"), **curve_gap(rec, base_rec))  # fmt: skip
                row["of_ideal"] = row["speedup"] / row["ideal"]
                if mode in inputs:
                    costs = _model_codec(inputs[mode], rates, codec, args.model_codec)
                    pred = predict(inputs[mode], link_of(res, args.burst, args.delay), codec, costs, slices)
                    row.update(model_step_s=pred, model_err_pct=100 * (pred - s["step_s"]) / s["step_s"])
                rows.append(row)
    links = {
        res["rate_mbit"]: dict(
            res["calib"], probe_bytes_per_s=res["probe"]["bytes_per_s"], rtt_s=res["probe"]["rtt_s"]
        )
        for res in results
    }
    return dict(rows=rows, wire_dtype=checks, model_inputs=inputs, links=links, codec_rates=rates)


def model_curves(report: dict[str, Any], args: argparse.Namespace, slices: int) -> dict[str, Any]:
    """Modeled speedup on a dense grid of link rates: bandwidth = rate x the probed efficiency,
    averaged over the capped links."""
    links = [(r, c) for r, c in report["links"].items() if r]
    if not links or not report["model_inputs"]:
        return {}
    eff = statistics.fmean(c["probe_bytes_per_s"] * 8 / 1e6 / r for r, c in links)
    lo, hi = min(r for r, _ in links), max(r for r, _ in links)
    grid = [lo * (hi / lo) ** (i / 40) for i in range(41)] if hi > lo else [lo]
    curves: dict[str, Any] = {}
    for mode, inp in report["model_inputs"].items():
        for codec in args.codecs:
            costs = _model_codec(inp, report["codec_rates"], codec, args.model_codec)
            pts = []
            for rate in grid:
                bw = rate * 1e6 / 8 * eff
                link = cm.Link("emulated lo", bw, args.delay / 1e3, shared=True, burst=tc_bytes(args.burst))
                base = predict(inp, link, "none", None, slices)
                pts.append((rate, base / predict(inp, link, codec, costs, slices)))
            curves[f"{mode}/{codec}"] = pts
    return curves


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and v != v) else format(v, spec)


def format_report(report: dict[str, Any]) -> str:
    head = (f"{'link':>10} {'codec':<14} {'step ms':>9} {'tok/s':>7} {'f':>5} {'f_cap':>5} {'r':>5} "
            f"{'speedup':>7} {'ideal':>6} {'of ideal':>8} {'model ms':>9} {'err %':>6} {'val loss':>8} "
            f"{'gap %':>6} {'train gap %':>11} {'curve %':>7} {'load':>5}")  # fmt: skip
    lines = []
    for mode in dict.fromkeys(r["mode"] for r in report["rows"]):
        chk = report["wire_dtype"].get(mode)
        dt = f"; TP bytes/elem on the wire: fwd {chk['fwd']:.2f}, bwd {chk['bwd']:.2f}" if chk else ""
        lines += ["", f"comm {mode}: {MODES[mode]}{dt}", head]
        for r in (r for r in report["rows"] if r["mode"] == mode):
            link = f"{r['rate_mbit']:g} Mb/s" if r["rate_mbit"] else "uncapped"
            base = r["codec"] == "none"
            lines.append(
                f"{link:>10} {r['codec']:<14} {r['step_s'] * 1e3:>9.1f} {r['tokens_per_s']:>7.0f} "
                f"{r['f']:>5.2f} {_fmt(r['f_cap'], '>5.2f')} {r['r']:>5.2f} {r['speedup']:>7.2f} "
                f"{r['ideal']:>6.2f} {'-' if base else format(r['of_ideal'], '>7.1%'):>8} "
                f"{_fmt(r.get('model_step_s', float('nan')) * 1e3, '>9.1f')} "
                f"{_fmt(r.get('model_err_pct'), '>+6.1f')} {r['val_loss']:>8.4f} "
                f"{'-' if base else format(r['val_gap_pct'], '>+6.3f'):>6} "
                f"{'-' if base else format(r['train_gap_pct'], '>+11.3f'):>11} "
                f"{'-' if base else format(r['curve_gap_pct'], '>+7.3f'):>7} {_fmt(r['load'], '>5.1f')}"
            )
    return "\n".join(lines)


def format_markdown(report: dict[str, Any]) -> str:
    """The capped rows of every mode as one markdown table (the README's and docs/cluster.md's)."""
    head = ["comm", "link Mbit/s", "baseline ms/step", "f", "TACO ms/step", "r", "speedup", "ideal",
            "of ideal", "model err base / codec", "val loss gap"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = report["rows"]
    for r in rows:
        if r["codec"] == "none" or not r["rate_mbit"]:
            continue
        key = (r["mode"], r["rate_mbit"], "none")
        base = next(b for b in rows if (b["mode"], b["rate_mbit"], b["codec"]) == key)
        err = (f"{base['model_err_pct']:+.1f}% / {r['model_err_pct']:+.1f}%" if "model_err_pct" in r
               else "-")  # fmt: skip
        cells = [r["mode"], f"{r['rate_mbit']:g}", f"{base['step_s'] * 1e3:.0f}", f"{r['f']:.2f}",
                 f"{r['step_s'] * 1e3:.0f}", f"{r['r']:.2f}", f"**{r['speedup']:.2f}x**",
                 f"{r['ideal']:.2f}x", f"{r['of_ideal']:.1%}", err, f"{r['val_gap_pct']:+.2f}%"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def acceptance(report: dict[str, Any]) -> str:
    """The issue's criteria per mode and codec, as measured (never adjusted)."""
    lines = []
    keys = dict.fromkeys((r["mode"], r["codec"]) for r in report["rows"] if r["codec"] != "none")
    for mode, codec in keys:
        rows = [r for r in report["rows"] if (r["mode"], r["codec"]) == (mode, codec) and r["rate_mbit"]]
        if not rows:
            continue
        comm_bound = [r for r in rows if r["f"] >= 0.85]
        if comm_bound:
            ok = "met" if all(r["speedup"] >= 1.6 for r in comm_bound) else "NOT met"
            at = ", ".join(
                f"{r['rate_mbit']:g} Mbit/s (f={r['f']:.2f}) {r['speedup']:.2f}x" for r in comm_bound
            )
            s1 = f"where f >= 0.85: {at} vs >= 1.6x: {ok}"
        else:
            s1 = f"no swept link has f >= 0.85 (max {max(r['f'] for r in rows):.2f})"
        worst = min(rows, key=lambda r: r["of_ideal"])
        s2 = f"min of ideal {worst['of_ideal']:.1%} at {worst['rate_mbit']:g} Mbit/s (>= 85%: "
        s2 += ("met" if worst["of_ideal"] >= 0.85 else "NOT met") + ")"
        errs = [abs(r["model_err_pct"]) for r in report["rows"] if r["mode"] == mode and "model_err_pct" in r]
        s3 = (
            f"model max |err| {max(errs):.1f}% (<= 15%: {'met' if max(errs) <= 15 else 'NOT met'})"
            if errs
            else ""
        )
        gap, train = rows[0]["val_gap_pct"], rows[0]["train_gap_pct"]  # the same at every rate
        s4 = f"val loss gap {gap:+.3f}% (|gap| <= 0.25%: {'met' if abs(gap) <= 0.25 else 'NOT met'})"
        s4 += f", last-5 train loss gap {train:+.3f}%, mean per-step gap {rows[0]['curve_gap_pct']:+.3f}%"
        lines.append(f"{mode}/{codec}: {s1}; {s2}; {s3}; {s4}")
    return "\n".join(lines)


def _load_cfg(args: argparse.Namespace) -> Any:
    from taco.train.config import load_config

    overrides = [f"--{o.removeprefix('--')}" for o in args.set] + list(getattr(args, "overrides", []) or [])
    cfg = load_config(args.config, overrides)
    if cfg.parallel.sp or cfg.parallel.pp > 1 or cfg.parallel.dp > 1:
        raise ValueError("the emulation runs TP only (sp=false, pp=dp=1)")
    return cfg


def _measure(args: argparse.Namespace) -> tuple[Any, list[dict[str, Any]], dict[str, Any]]:
    """Run every (link, mode, codec) training job: the config, the per-rate results, codec rates."""
    from taco.train.data import resolve_data_dir

    cfg = _load_cfg(args)
    data_dir = resolve_data_dir(cfg.data, prepare=True)  # on the host: the netns has no network
    specs = plan_runs(cfg, args, data_dir)
    numel = cfg.train.batch_size * cfg.model.seq_len * cfg.model.hidden
    rates = codec_rates(args.codecs, numel, args.threads, args.backend)
    results = [] if args.uncapped == "none" else [execute(None, specs, args)]
    results += [execute(rate, specs, args) for rate in args.rates]
    if args.uncapped == "both":  # brackets the capped runs: drift or a busy box shows as a difference
        results.append(execute(None, specs, args))
    return cfg, results, rates


def _load_saved(args: argparse.Namespace) -> tuple[Any, list[dict[str, Any]], dict[str, Any]]:
    """The measurements of an earlier `--json` file (to re-analyse without running)."""
    from taco.train.config import Config

    saved = json.loads(Path(args.from_json).read_text())
    results = saved["results"]
    args.comm = list(saved["meta"]["modes"])
    runs = [r for res in results for r in res["runs"]]
    args.codecs = list(dict.fromkeys(r["codec"] for r in runs if r["codec"] != "none"))
    args.rates = [res["rate_mbit"] for res in results if res["rate_mbit"]]
    args.warmup = args.warmup if args.warmup_set else saved["meta"]["warmup"]
    args.burst = saved["meta"]["burst"]
    args.delay = saved["meta"].get("delay_ms", 0.0)
    return Config.from_dict(saved["meta"]["config"]), results, saved["codec_rates"]


@cli_entry("taco bench cluster")
def run_cluster(args: argparse.Namespace) -> int:
    """Run the sweep described by `args`; print the tables; 0 on success, 2 (one line on stderr)
    without root or for options the emulation does not take."""
    if args.worker:
        return _worker(args.worker)
    if args.from_json:
        args.warmup_set = args.warmup is not None
        cfg, results, rates = _load_saved(args)
    else:
        if args.rates:
            require_root()
        args.warmup = 3 if args.warmup is None else args.warmup
        cfg, results, rates = _measure(args)
    report = analyse(results, cfg, args, rates)
    print(format_report(report))
    print("\n" + acceptance(report))
    curves = model_curves(report, args, cfg.compression.slices)
    if args.json:
        meta = dict(argv=sys.argv[1:], config=cfg.to_dict(), torch=torch.__version__, cpus=os.cpu_count(),
                    threads=args.threads, backend=args.backend, burst=args.burst, mtu=args.mtu,
                    delay_ms=args.delay, warmup=args.warmup,
                    modes={m: MODES[m] for m in args.comm})  # fmt: skip
        report["model_inputs"] = {
            m: dict(v, messages=len(v["messages"]), codecs={c: vars(k) for c, k in v["codecs"].items()})
            for m, v in report["model_inputs"].items()
        }
        Path(args.json).write_text(
            json.dumps(dict(meta=meta, results=results, curves=curves, **report), indent=1)
        )
        print(f"wrote {args.json}")
    if args.markdown:
        Path(args.markdown).write_text(format_markdown(report) + "\n")
        print(f"wrote {args.markdown}")
    if args.plot:
        from .plots import plot_speedup, plot_validation

        plot_speedup(report["rows"], curves, args.plot)
        print(f"wrote {args.plot}")
        if any("model_step_s" in r for r in report["rows"]):
            val = str(Path(args.plot).with_name(Path(args.plot).stem + "_model.png"))
            plot_validation(report["rows"], val)
            print(f"wrote {val}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m taco.bench.cluster", description=__doc__.split("\n")[0])
    add_arguments(p)
    args, extra = p.parse_known_args(argv)
    bad = [e for e in extra if not e.startswith("--") or "." not in e.split("=")[0]]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)}")
    args.overrides = extra  # `--train.steps=20` style, as `taco train` takes them
    return run_cluster(args)


if __name__ == "__main__":
    sys.exit(main())
