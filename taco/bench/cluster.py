"""`taco bench cluster`: end-to-end training speed on a bandwidth-limited emulated network (docs/design.md 3).

Why this file exists: on one machine ranks talk at memory speed, so only an emulated slow link
shows what TP compression buys a whole training step. This runs the same short training job
(config + overrides, e.g. a tiny GPT with TP=2) with the uncompressed baseline and each codec,
all ranks inside a network namespace whose `lo` is capped by `tc` (`netns.py`), one compute
thread per rank, at each rate of `--rates`. It reports tokens/s, the measured communication
share f of a baseline step, the wire ratio r (raw / wire bytes), the speedup, the ideal speedup
1 / (1 - f + f / r), the achieved fraction of it, the loss gap, and the step time the cost model
(`cost_model.py`) predicts from uncapped measurements and a probe of the capped link.
This file is the orchestration (arguments, planning the runs, the workers in the capped
namespace, the probe and calibration of each link); the records, their analysis and the report
are `cluster_records.py`, `cluster_analysis.py` and `cluster_report.py`.

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

from taco.codec.specs import parse_ladder, split_specs

from . import cluster_overlap as overlap
from . import peers as peer_runs
from .cluster_analysis import AUTO_CODEC, Sweep, analyse, auto_base, model_curves
from .cluster_noise import CONTROL
from .cluster_records import MODES, LinkResult, RunRecord
from .cluster_report import format_markdown, format_report, load_sweep, write_json, write_plots
from .cluster_rounds import rank_round
from .codec import best_time
from .netns import ROOT, NetNamespace, child_env, require_root
from .ranks import comma_list as _csv
from .ranks import gloo_rank, spawn_ranks

MODE_DTYPES = {"bf16": ("bf16", "bf16"), "autocast": ("bf16", "input"), "fp32": ("fp32", "fp32")}
"""(train.dtype, parallel.tp_comm_dtype) of each communication mode (`MODES`)"""


HELP = "end-to-end training on a tc-capped emulated link"
TAKES_OVERRIDES = True  # `--train.steps=20` style extras, as `taco train` takes them


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=str(ROOT / "configs" / "cluster.toml"), help="training config TOML")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="config override")
    p.add_argument("--rates", type=_csv(float), default=[50, 100, 200, 400, 1000], help="lo caps, Mbit/s")
    codecs = (f'codecs; the baseline always runs; "auto": {AUTO_CODEC} with compression.when = "auto", '
              '"auto:CODEC": CODEC with it')
    p.add_argument("--codecs", type=split_specs, default=["taco"], help=codecs)
    p.add_argument("--peers", type=_csv(str), default=[], help="uncompressed peers in the same rounds: "
                   "megatron (Megatron-Core's TP layers), dtensor (DTensor's TP plan); skipped if missing")
    p.add_argument("--comm", type=_csv(str), default=["bf16", "fp32"], help=f"modes: {', '.join(MODES)}")
    p.add_argument("--warmup", type=int, default=None, help="first steps left out of the timing (3)")
    p.add_argument("--threads", type=int, default=1, help="compute threads per rank")
    p.add_argument("--backend", choices=("auto", "eager"), default="auto", help="auto: import taco.kernels")
    p.add_argument("--pin-cores", action=argparse.BooleanOptionalAction, default=True,
                   help="bind each rank to its own share of the cores: no migrations, less step noise")
    p.add_argument("--burst", default="32kb", help="tc tbf burst")
    p.add_argument("--latency", default="400ms", help="tc tbf latency (queue bound, not a delay)")
    p.add_argument("--delay", type=float, default=0.0, help="netem one-way delay in ms (needs sch_netem)")
    p.add_argument("--mtu", type=int, default=16384, help="lo MTU in the namespace (must fit in the burst)")
    p.add_argument("--uncapped", choices=("both", "first", "none"), default="both",
                   help="uncapped reference runs before and after the capped ones (averaged), before, "
                        "or none (then no f_cap and no model)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each (mode, codec) per link, in alternating order (A B B A ..), pooled: "
                        "drift between runs cancels in the ratios; from 2 on the baseline also runs as "
                        "an A/A control and each speedup gets a 95%% interval (the noise floor)")  # fmt: skip
    p.add_argument("--uncapped-steps", type=int, default=200,
                   help="uncapped runs train at least this many steps (0: train.steps): their step "
                        "times scatter the most, and they are the cheapest to lengthen")  # fmt: skip
    p.add_argument("--block-steps", type=int, default=1,
                   help="the runs of a round share one set of rank processes and take turns of "
                        "this many steps (A B C, C B A ..): drift cancels in the ratios")  # fmt: skip
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


def _world(cfg: dict[str, Any]) -> int:
    return cfg["parallel"]["dp"] * cfg["parallel"]["pp"] * cfg["parallel"]["tp"]


def _worker(job_path: str) -> int:
    """Run every round of a job file (one link rate) and write the records next to it: the runs of a
    round share one set of rank processes and take turns (`cluster_rounds.py`)."""
    job = json.loads(Path(job_path).read_text())
    spec0 = job["rounds"][0][0]["config"]
    numel = spec0["train"]["batch_size"] * spec0["model"]["seq_len"] * spec0["model"]["hidden"]
    out = LinkResult(job["rate_mbit"], probe_link(job["rate_mbit"]), calibrate_link(_world(spec0), numel), [])
    link = f"{job['rate_mbit']:g} Mbit/s" if job["rate_mbit"] else "uncapped"
    for specs in job["rounds"]:
        world = _world(specs[0]["config"])
        load0 = os.getloadavg()[0]
        recs = spawn_ranks(rank_round, world, dict(runs=specs, block=job["block"]))
        loads = [load0, os.getloadavg()[0]]  # the 1-min load average: ~world when the box is ours
        for spec, rec in zip(specs, recs):
            rec.update(mode=spec["mode"], codec=spec["codec"], rate_mbit=job["rate_mbit"], world=world)
            run = RunRecord.from_json(dict(rec, loadavg=loads))
            out.runs.append(run)
            s = run.summarize(spec["warmup"], 1)
            print(f"[cluster] {link:>12} {spec['mode']:<8} {spec['codec']:<14} {s.step_s * 1e3:9.1f} ms/step "
                  f"comm {s.comm_s * 1e3:8.1f} ms  val {run.val_loss:.4f}  load {s.load:.1f}",
                  flush=True)  # fmt: skip
        Path(job["out"]).write_text(json.dumps(out.to_json()))
    Path(job["out"]).write_text(json.dumps(out.to_json()))
    return 0


# ----------------------------------------------------------------------------- the parent


def plan_runs(cfg: Any, args: argparse.Namespace, data_dir: Path) -> list[dict[str, Any]]:
    """One spec per (comm mode, codec): the baseline "none" first in each mode; with `--repeats` >= 2
    the baseline again right after it as the A/A control (`cluster_noise.CONTROL`)."""

    bad = [m for m in args.comm if m not in MODES]
    if bad:
        raise ValueError(f"unknown --comm modes {bad}: choose from {', '.join(MODES)}")
    specs = []
    control = [CONTROL] if getattr(args, "repeats", 1) >= 2 else []
    for mode in args.comm:
        first = len(specs)
        for codec in ["none", *control, *[c for c in args.codecs if c not in ("none", CONTROL)]]:
            c = copy.deepcopy(cfg)
            dtype, comm_dtype = MODE_DTYPES[mode]
            c.train.dtype = type(c.train.dtype).parse(dtype, "train.dtype")
            choice = type(c.parallel.tp_comm_dtype)
            c.parallel.tp_comm_dtype = choice.parse(comm_dtype, "parallel.tp_comm_dtype")
            name = overlap.split_label(codec)[0]  # "CODEC+overlap" / "+chunked": CODEC, overlapped
            overlap.configure(c, codec)
            base = auto_base(name)  # "auto" / "auto:CODEC": that codec only where it pays
            plain = codec == CONTROL  # the A/A control runs the baseline's config
            c.compression.set_tp_codec("none" if plain else base or name)
            c.compression.when = "auto" if base else "always"
            # timed runs: no fidelity round trips inside the timing, but a ladder moves its sites by
            # them (one round trip per site every 10 steps, inside the timing it pays for)
            c.compression.telemetry_every = 10 if parse_ladder(c.compression.tp_codec) else 0
            c.train.resume = False
            c.train.out_dir = str(Path(tempfile.gettempdir()) / "taco-cluster")
            specs.append(dict(mode=mode, codec=codec, config=c.to_dict(), data_dir=str(data_dir),
                              threads=args.threads, backend=args.backend, warmup=args.warmup,
                              pin=getattr(args, "pin_cores", False),
                              timeout=min(args.timeout, 1800)))  # fmt: skip
        specs += peer_runs.peer_specs(specs[first], getattr(args, "peers", []))  # the baseline's job
    return specs


def interleave(specs: list[dict[str, Any]], repeats: int) -> list[dict[str, Any]]:
    """`repeats` rounds of `specs`, every other round reversed (A B, B A, A B ..): a slow drift of the
    box during the rounds weighs on every run alike once the rounds are pooled (`pool_runs`)."""
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    return [s for i in range(repeats) for s in (specs if i % 2 == 0 else specs[::-1])]


def with_min_steps(rounds: list[list[dict[str, Any]]], steps: int) -> list[list[dict[str, Any]]]:
    """The rounds with every run training at least `steps` steps (`--uncapped-steps`): an uncapped
    step is cheap and compute-bound, and its time scatters the most from step to step (about 10% on
    a 2-core box), so the uncapped runs average more steps (docs/cluster.md, "Repeats")."""
    out = copy.deepcopy(rounds)
    for spec in (s for r in out for s in r):
        train = spec["config"]["train"]
        train["steps"] = max(train["steps"], steps)
    return out


def _run_worker(argv: list[str], timeout: float) -> int:
    """Run the worker in its own process group; kill that group if anything goes wrong."""
    proc = subprocess.Popen(argv, env=child_env(), start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def execute(rate: float | None, rounds: list[list[dict[str, Any]]], args: argparse.Namespace) -> LinkResult:
    """All rounds of runs at one link rate (None: the host's uncapped lo); the worker's records."""
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.json"
        out = Path(tmp) / "out.json"
        job.write_text(json.dumps(dict(rate_mbit=rate, rounds=rounds, block=args.block_steps, out=str(out))))
        argv = [sys.executable, "-m", "taco.bench.cluster", "--worker", str(job)]
        qdisc = None
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
        res = LinkResult.from_json(json.loads(out.read_text()))
    res.qdisc = qdisc
    return res


def codec_rates(codecs: list[str], numel: int, threads: int, backend: str) -> dict[str, dict[str, float]]:
    """Elements/s of encode and decode per (codec, input dtype) at the TP message size, in place."""
    from taco.codec import build_codec

    if backend == "auto":
        import taco.kernels  # noqa: F401
    torch.set_num_threads(threads)
    out: dict[str, dict[str, float]] = {}
    for spec in dict.fromkeys(overlap.split_label(c)[0] for c in codecs):
        codec = build_codec(auto_base(spec) or spec)
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


def _load_cfg(args: argparse.Namespace) -> Any:
    from taco.train.config import load_config

    extra = list(getattr(args, "overrides", []) or [])
    bad = [e for e in extra if not e.startswith("--") or "." not in e.split("=")[0]]
    if bad:
        raise ValueError(f"unrecognized arguments: {' '.join(bad)} (overrides look like --train.steps=20)")
    overrides = [f"--{o.removeprefix('--')}" for o in args.set] + extra
    cfg = load_config(args.config, overrides)
    if cfg.parallel.sp or cfg.parallel.pp > 1 or cfg.parallel.dp > 1:
        raise ValueError("the emulation runs TP only (sp=false, pp=dp=1)")
    return cfg


def _measure(args: argparse.Namespace) -> tuple[Any, list[LinkResult], dict[str, Any]]:
    """Run every (link, mode, codec) training job: the config, the per-rate results, codec rates."""
    from taco.train.data import resolve_data_dir

    cfg = _load_cfg(args)
    data_dir = resolve_data_dir(cfg.data, prepare=True)  # on the host: the netns has no network
    specs = plan_runs(cfg, args, data_dir)
    flat = interleave(specs, args.repeats)
    rounds = [flat[i : i + len(specs)] for i in range(0, len(flat), len(specs))]
    numel = cfg.train.batch_size * cfg.model.seq_len * cfg.model.hidden
    rates = codec_rates(args.codecs, numel, args.threads, args.backend)
    longer = with_min_steps(rounds, getattr(args, "uncapped_steps", 0))
    results = [] if args.uncapped == "none" else [execute(None, longer, args)]
    results += [execute(rate, rounds, args) for rate in args.rates]
    if args.uncapped == "both":  # brackets the capped runs: drift or a busy box shows as a difference
        results.append(execute(None, longer, args))
    return cfg, results, rates


def _load_saved(args: argparse.Namespace) -> tuple[Any, list[LinkResult], dict[str, Any]]:
    """The measurements of an earlier `--json` file (to re-analyse without running)."""
    from taco.train.config import Config

    meta, results, rates = load_sweep(args.from_json)
    args.comm = list(meta["modes"])
    runs = [r for res in results for r in res.runs]
    labels = dict.fromkeys(r.codec for r in runs if r.codec not in ("none", CONTROL))
    args.codecs, args.peers = peer_runs.split_labels(list(labels))
    args.rates = [res.rate_mbit for res in results if res.rate_mbit]
    args.warmup = meta["warmup"] if args.warmup is None else args.warmup
    args.burst = meta["burst"]
    args.delay = meta.get("delay_ms", 0.0)
    args.repeats = meta.get("repeats", 1)
    args.fused_reduce = meta.get("fused_reduce", False)  # sweeps saved before the fused path: unfused
    return Config.from_dict(meta["config"]), results, rates


def run_cluster(args: argparse.Namespace) -> int:
    """Run the sweep described by `args`; print the tables; 0 on success, 2 (one line on stderr)
    without root or for options the emulation does not take."""
    if args.worker:
        return _worker(args.worker)
    if args.from_json:
        cfg, results, rates = _load_saved(args)
    else:
        if args.rates:
            require_root()
        args.warmup = 3 if args.warmup is None else args.warmup
        args.peers, args.peer_skips = peer_runs.runnable_peers(args.peers)
        cfg, results, rates = _measure(args)
    sweep = Sweep.of(cfg, modes=args.comm, codecs=args.codecs, warmup=args.warmup, burst=args.burst,
                     delay_ms=args.delay, model_codec=args.model_codec,
                     fused_reduce=getattr(args, "fused_reduce", True),
                     peers=[peer_runs.label(n) for n in args.peers])  # fmt: skip
    report = analyse(results, sweep, rates)
    print(format_report(report))
    curves = model_curves(report, sweep)
    if args.json:
        meta = dict(argv=sys.argv[1:], config=cfg.to_dict(), torch=torch.__version__, cpus=os.cpu_count(),
                    threads=args.threads, backend=args.backend, burst=args.burst, mtu=args.mtu,
                    delay_ms=args.delay, warmup=args.warmup, fused_reduce=sweep.fused_reduce,
                    repeats=args.repeats, block_steps=getattr(args, "block_steps", None),
                    uncapped_steps=getattr(args, "uncapped_steps", None),
                    pin_cores=getattr(args, "pin_cores", None),
                    modes={m: MODES[m] for m in args.comm}, peers=args.peers,
                    peer_skips=getattr(args, "peer_skips", []))  # fmt: skip
        write_json(args.json, meta, results, curves, report)
        print(f"wrote {args.json}")
    if args.markdown:
        Path(args.markdown).write_text(format_markdown(report) + "\n")
        print(f"wrote {args.markdown}")
    if args.plot:
        for path in write_plots(report, curves, args.plot):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":  # `python -m taco.bench.cluster ARGS` = `taco bench cluster ARGS`
    from taco.cli import main

    sys.exit(main(["bench", "cluster", *sys.argv[1:]]))
