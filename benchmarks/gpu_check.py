"""The measurement steps of `benchmarks/gpu_check.sh` (issue 11), one subcommand each.

    python benchmarks/gpu_check.py versions              # python / torch / CUDA / triton / GPU
    python benchmarks/gpu_check.py bandwidth [--dry-run] # encode, decode, decode-sum-encode vs a copy
    python benchmarks/gpu_check.py host [--dry-run]      # CPU time to issue one encode + decode
    python benchmarks/gpu_check.py replay [--dry-run]    # one rank of an N=8 two-shot all-reduce
    python benchmarks/gpu_check.py corpus DIR [--mb X]   # a generated text corpus (offline data)
    python benchmarks/gpu_check.py train-check RUN_DIR --device cuda
                                                          # params on the device, loss falls, tok/s

Without --dry-run the kernels run on CUDA (the step fails if there is none); with --dry-run they
run on the CPU through the Triton interpreter (TRITON_INTERPRET=1, set by the shell script) at
tiny sizes, so only that the code runs is checked, not the figures.
Every step prints its table and "KEY <text>" lines, which the shell script collects as the key
figures of its summary. Exit status: 0 ok, anything else a failure.

Timing on the GPU (`gpu_seconds`): a `torch.cuda._sleep` kernel is queued first, so that the CPU
has issued all the timed calls before the GPU reaches the start event; the events then time the
calls back to back, without the host's launch gaps (those are what the `host` step measures).
Median over repeats of `inner` calls each, after a warm-up (which also compiles the kernels).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

MIB = 2**20


def key(text: str) -> None:
    """A key figure for the summary table of gpu_check.sh."""
    print(f"KEY {text}", flush=True)


# -- devices and timing ----------------------------------------------------------------------------
def pick_device(dry: bool):
    import torch

    if dry:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--dry-run needs TRITON_INTERPRET=1 in the environment (gpu_check.sh sets it)")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        key("no CUDA device (use --dry-run on a CPU machine)")
        sys.exit(3)
    return torch.device("cuda")


class Timer:
    """GPU time of back-to-back calls (CUDA events behind a sleep kernel), or CPU wall time."""

    def __init__(self, device, reps: int, inner: int, warmup: int = 3) -> None:
        import torch

        self.torch = torch
        self.cuda = device.type == "cuda"
        self.reps, self.inner, self.warmup = reps, inner, warmup
        self.cycles_per_s = self._calibrate() if self.cuda else 0.0

    def _calibrate(self) -> float:
        torch = self.torch
        if not hasattr(torch.cuda, "_sleep"):
            return 0.0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # first launch
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        return 10_000_000 / (start.elapsed_time(end) / 1e3)

    def issue_seconds(self, fn: Callable[[], object]) -> float:
        """CPU seconds to issue one call (no synchronisation inside the loop)."""
        sync = self.torch.cuda.synchronize if self.cuda else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(self.inner):
            fn()
        t = (time.perf_counter() - t0) / self.inner
        sync()
        return t

    def seconds(self, fn: Callable[[], object]) -> float:
        """Median seconds per call."""
        torch = self.torch
        for _ in range(self.warmup):
            fn()
        if not self.cuda:
            out = []
            for _ in range(self.reps):
                t0 = time.perf_counter()
                for _ in range(self.inner):
                    fn()
                out.append((time.perf_counter() - t0) / self.inner)
            return statistics.median(out)
        issue = self.issue_seconds(fn)
        out = []
        for _ in range(self.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            if self.cycles_per_s:  # keep the GPU busy while the calls are issued
                torch.cuda._sleep(int(min(2 * issue * self.inner + 2e-4, 0.5) * self.cycles_per_s))
            start.record()
            for _ in range(self.inner):
                fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3 / self.inner)
        return statistics.median(out)


# -- the codecs with a Triton kernel ---------------------------------------------------------------
def triton_codecs(device) -> list:
    """Every registered codec whose wire-level calls the Triton kernels serve on `device`.

    Asked of taco.kernels (its dispatch, `_path`), not hard-coded: each codec of `list_codecs()`
    that accepts a backend, built with backend="triton" and default options.
    """
    import taco
    import taco.kernels as K
    from taco.codec import accepted_options

    if not K.triton_available():
        return []
    out = []
    for name in taco.list_codecs():
        opts = accepted_options(name, {"backend": "triton"})
        if not opts:
            continue
        c = taco.get_codec(name, **opts)
        if K._path(c, device) == "triton":
            out.append(c)
    return out


def need_codecs(device, dry: bool = False) -> list:
    """The codecs to measure: all of `triton_codecs`; in a dry run one per family (the interpreter
    is slow, and the families are what differs in the kernels)."""
    codecs = triton_codecs(device)
    if not codecs:
        key("no codec is served by the Triton kernels here (is triton installed?)")
        sys.exit(4)
    print("codecs with a Triton kernel: " + ", ".join(c.spec for c in codecs), flush=True)
    if dry:
        first = {}
        for c in codecs:
            first.setdefault(c.family, c)
        codecs = list(first.values())
        print("dry run, one per family: " + ", ".join(c.name for c in codecs), flush=True)
    return codecs


def size_str(mib: float) -> str:
    return f"{mib:g}MiB" if mib >= 0.25 else f"{mib * 1024:g}KiB"


def fmt_us(t: float) -> str:
    return f"{t * 1e6:9.1f}"


# -- step: versions --------------------------------------------------------------------------------
def cmd_versions(args: argparse.Namespace) -> int:
    print(f"python  {sys.version.split()[0]} ({platform.platform()})")
    try:
        import torch
    except ImportError as e:
        key(f"python {sys.version.split()[0]}; torch missing: {e}")
        return 1
    cuda = torch.version.cuda or "none"
    print(f"torch   {torch.__version__} (CUDA build {cuda}, cuda available: {torch.cuda.is_available()})")
    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = "missing"
    print(f"triton  {tv}   TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')}")
    gpu = "no GPU"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        gpu = f"{p.name} {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs"
        print(f"gpu     {gpu} (device count {torch.cuda.device_count()})")
    import taco
    import taco.kernels as K

    print(f"taco    {taco.__file__}; auto backends cpu={K.auto_order('cpu')} cuda={K.auto_order('cuda')}")
    key(f"torch {torch.__version__} cuda {cuda} triton {tv}; {gpu}")
    return 0


# -- step: bandwidth -------------------------------------------------------------------------------
def cmd_bandwidth(args: argparse.Namespace) -> int:
    """Encode / decode / decode-sum-encode of a bf16 message, as time ratios to a copy of it."""
    import torch

    import taco.kernels as K
    from taco.comm.compressed import group_unit, split_sizes

    dev = pick_device(args.dry_run)
    codecs = need_codecs(dev, args.dry_run)
    sizes = [1 / 256] if args.dry_run else [16, 64, 256]
    timer = Timer(dev, reps=1, inner=1, warmup=1) if args.dry_run else Timer(dev, reps=15, inner=10)
    nway = 8
    print(
        f"time of each op / time of a device-to-device copy of the same bf16 message (lower is better);\n"
        f"dse = decode-sum-encode of the {nway} terms of one rank's slice ({nway - 1} received chunks + "
        f"its own raw chunk, 1/{nway} of the message each: the all-reduce middle step, N = {nway});\n"
        "bw = op bytes/s over copy bytes/s (bytes = read + written)"
    )
    print(
        f"{'codec':36s} {'size':>8s} {'copy us':>9s} {'GB/s':>7s} "
        f"{'encode':>14s} {'decode':>14s} {'dse':>14s}"
    )
    worst = {}
    for c in codecs:
        for mib in sizes:
            n = int(mib * MIB) // 2
            x = torch.randn(n, device=dev).to(torch.bfloat16)
            y = torch.empty_like(x)
            nb = c.nbytes(n)
            buf = torch.empty(nb, dtype=torch.uint8, device=dev)
            K.encode_into(c, x, buf)
            m = split_sizes(n, nway, group_unit(c))[0]
            mb = c.nbytes(m)
            recv = torch.cat([c.encode(x[k * m : (k + 1) * m]).data for k in range(1, nway)])
            own = x[:m]
            out = torch.empty(mb, dtype=torch.uint8, device=dev)
            t_copy = timer.seconds(lambda: y.copy_(x))  # noqa: B023 - called inside the iteration
            t = {
                "encode": timer.seconds(lambda: K.encode_into(c, x, buf)),  # noqa: B023
                "decode": timer.seconds(lambda: K.decode_from(c, buf, n, torch.bfloat16)),  # noqa: B023
                "dse": timer.seconds(
                    lambda: K.decode_sum_encode(c, recv, m, out=out, own=own, own_index=0)  # noqa: B023
                ),
            }
            moved = {"encode": 2 * n + nb, "decode": nb + 2 * n, "dse": recv.numel() + 2 * m + mb}
            cells = []
            for op in ("encode", "decode", "dse"):
                ratio = t[op] / t_copy
                bw = (moved[op] / t[op]) / (4 * n / t_copy)
                cells.append(f"{ratio:5.2f}x {bw:4.2f}bw")
                if mib == max(sizes):
                    worst[(c.name, op)] = ratio
            print(
                f"{c.spec:36s} {size_str(mib):>8s} {fmt_us(t_copy)} {4 * n / t_copy / 1e9:7.1f} "
                + " ".join(f"{s:>14s}" for s in cells),
                flush=True,
            )
    big, parts = max(sizes), []
    for op in ("encode", "decode", "dse"):
        vals = [r for (_, o), r in worst.items() if o == op]
        parts.append(f"{op} {min(vals):.2f}-{max(vals):.2f}")
    ref = "taco" if any(name == "taco" for name, _ in worst) else next(iter(worst))[0]
    mine = "/".join(f"{worst[(ref, op)]:.2f}" for op in ("encode", "decode", "dse"))
    key(f"x copy time at {size_str(big)}: " + ", ".join(parts) + f" ({ref} {mine})")
    return 0


# -- step: host overhead ---------------------------------------------------------------------------
def cmd_host(args: argparse.Namespace) -> int:
    """CPU time spent issuing encode + decode of one message vs the GPU time of the two kernels."""
    import torch

    dev = pick_device(args.dry_run)
    codecs = need_codecs(dev, args.dry_run)
    sizes = [1 / 256, 1 / 128] if args.dry_run else [0.25, 0.5, 1, 2, 4]
    inner = 2 if args.dry_run else 50
    timer = Timer(dev, reps=1 if args.dry_run else 7, inner=inner, warmup=1 if args.dry_run else 3)
    print(
        "per call = codec.encode(x, out=buf) + codec.decode(codec.wrap(buf), out=y) of a bf16 message\n"
        f"host = CPU seconds issuing the call ({inner} calls, synchronize only after the loop); "
        "gpu = kernel time back to back; wall = issue loop + synchronize, per call.\n"
        "host/gpu > 1: the calls are launch-bound at that size"
    )
    print(f"{'codec':36s} {'size':>8s} {'host us':>9s} {'gpu us':>9s} {'wall us':>9s} {'host/gpu':>9s}")
    rows = []
    for c in codecs:
        for mib in sizes:
            n = int(mib * MIB) // 2
            x = torch.randn(n, device=dev).to(torch.bfloat16)
            y = torch.empty_like(x)
            buf = torch.empty(c.nbytes(n), dtype=torch.uint8, device=dev)

            def call(c=c, x=x, y=y, buf=buf, n=n):
                c.encode(x, out=buf)
                c.decode(c.wrap(buf, (n,), torch.bfloat16), out=y)

            gpu = timer.seconds(call)  # warms up (compiles) first
            issue = statistics.median(timer.issue_seconds(call) for _ in range(1 if args.dry_run else 3))
            sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
            sync()
            t0 = time.perf_counter()
            for _ in range(inner):
                call()
            sync()
            wall = (time.perf_counter() - t0) / inner
            rows.append((c.name, mib, issue, gpu))
            print(
                f"{c.spec:36s} {size_str(mib):>8s} {fmt_us(issue)} {fmt_us(gpu)} {fmt_us(wall)} "
                f"{issue / gpu:9.2f}",
                flush=True,
            )
    names = [c.name for c in codecs]
    first = "taco" if "taco" in names else names[0]
    mine = [(mib, issue, gpu) for name, mib, issue, gpu in rows if name == first]
    ends = ", ".join(f"{size_str(m)} {i * 1e6:.0f}/{g * 1e6:.0f}" for m, i, g in (mine[0], mine[-1]))
    bound = [m for m, i, g in mine if i > g]
    limit = f"launch-bound up to {size_str(max(bound))}" if bound else "never launch-bound"
    key(f"{first} host/gpu us per call: {ends}; {limit}")
    return 0


# -- step: all-reduce replay -----------------------------------------------------------------------
class RankReplay:
    """What one rank of an N-rank two-shot all-reduce computes (taco.comm.compressed), no transfer.

    The message is cut into N chunks (`split_sizes`, whole codec groups); this is rank `rank`:
    encode:  the N-1 chunks of the other ranks into the all-to-all send buffer (`codec.encode`);
    middle:  the N-1 received wire chunks of its own chunk + its own raw values -> fp32 sum in rank
             order -> encode, fused (`taco.kernels.decode_sum_encode`) or unfused (decode each
             to fp32, add, encode: what `AllReduceSlice.middle` does today);
    finish:  decode the N wire chunks of the all-gather (own included) into the output.
    The received buffers hold real encodings (of other random messages), so the data is realistic.
    """

    def __init__(self, codec, n: int, nway: int, rank: int, device) -> None:
        import torch

        from taco.comm.compressed import group_unit, split_sizes

        self.torch, self.c, self.nway, self.rank = torch, codec, nway, rank
        self.sizes = split_sizes(n, nway, group_unit(codec))
        if len(set(self.sizes)) != 1:
            raise ValueError(f"{n} elements do not split into {nway} equal chunks of whole groups")
        m = self.m = self.sizes[0]
        self.nb = codec.nbytes(m)
        self.x = torch.randn(n, device=device).to(torch.bfloat16)
        self.dst = torch.empty_like(self.x)
        self.send = torch.empty((nway - 1) * self.nb, dtype=torch.uint8, device=device)
        others = [torch.randn(m, device=device).to(torch.bfloat16) for _ in range(nway - 1)]
        self.recv = torch.cat([codec.encode(o).data for o in others])
        self.ag_send = torch.empty(self.nb, dtype=torch.uint8, device=device)
        self.ag_recv = torch.cat([codec.encode(torch.randn(m, device=device)).data for _ in range(nway)])

    def chunk(self, t, j: int):
        return t[j * self.m : (j + 1) * self.m]

    def encode(self) -> None:
        c, k = self.c, 0
        for j in range(self.nway):
            if j != self.rank:
                c.encode(self.chunk(self.x, j), out=self.send[k * self.nb : (k + 1) * self.nb])
                k += 1

    def middle_fused(self) -> None:
        import taco.kernels as K

        own = self.chunk(self.x, self.rank)
        K.decode_sum_encode(self.c, self.recv, self.m, out=self.ag_send, own=own, own_index=self.rank)

    def middle_unfused(self) -> None:
        torch, c = self.torch, self.c
        acc = None
        for j in range(self.nway):
            if j == self.rank:
                term = self.chunk(self.x, j).to(torch.float32, copy=True)
            else:
                o = (j - (j > self.rank)) * self.nb
                term = c.decode(c.wrap(self.recv[o : o + self.nb], (self.m,), torch.float32))
            acc = term if acc is None else acc.add_(term)
        c.encode(acc, out=self.ag_send)

    def finish(self) -> None:
        c = self.c
        for j in range(self.nway):
            buf = self.ag_recv[j * self.nb : (j + 1) * self.nb]
            c.decode(c.wrap(buf, (self.m,), self.torch.bfloat16), out=self.chunk(self.dst, j))

    def fused(self) -> None:
        self.encode()
        self.middle_fused()
        self.finish()

    def unfused(self) -> None:
        self.encode()
        self.middle_unfused()
        self.finish()

    def agreement(self) -> float:
        """Fraction of wire bytes where the fused and unfused middle steps differ (expected ~0)."""
        self.middle_fused()
        a = self.ag_send.clone()
        self.middle_unfused()
        return (a != self.ag_send).float().mean().item()


def cmd_replay(args: argparse.Namespace) -> int:
    import torch

    dev = pick_device(args.dry_run)
    codecs = need_codecs(dev, args.dry_run)
    nway, rank = 8, 0
    mib = 1 / 256 if args.dry_run else 64
    n = int(mib * MIB) // 2
    timer = Timer(dev, reps=1, inner=1, warmup=0) if args.dry_run else Timer(dev, reps=9, inner=5)
    print(
        f"one rank (rank {rank}) of an N={nway} two-shot all-reduce of a {size_str(mib)} bf16 message, "
        "computation only (no transfer);\n"
        f"encode = {nway - 1} chunk encodes; middle = decode-sum-encode of {nway} terms "
        f"({nway - 1} received + own) fused in one kernel, or unfused (decode each in fp32, add, "
        f"encode);\nfinish = {nway} chunk decodes; times in us (GPU time back to back) and as a "
        "multiple of one D2D copy of the whole message; host = CPU time issuing the fused replay"
    )
    print(
        f"{'codec':36s} {'copy':>8s} {'encode':>8s} {'mid-fus':>8s} {'mid-unf':>8s} {'finish':>8s} "
        f"{'fused':>8s} {'unfused':>8s} {'fus/copy':>9s} {'unf/copy':>9s} {'mid f/u':>8s} {'host':>8s}"
    )
    status, figures = 0, {}
    for c in codecs:
        r = RankReplay(c, n, nway, rank, dev)
        y = torch.empty_like(r.x)
        differ = r.agreement()
        t_copy = timer.seconds(lambda: y.copy_(r.x))  # noqa: B023 - called inside the iteration
        t = {
            "encode": timer.seconds(r.encode),
            "mid_f": timer.seconds(r.middle_fused),
            "mid_u": timer.seconds(r.middle_unfused),
            "finish": timer.seconds(r.finish),
            "fused": timer.seconds(r.fused),
            "unfused": timer.seconds(r.unfused),
        }
        host = statistics.median(timer.issue_seconds(r.fused) for _ in range(1 if args.dry_run else 3))
        cells = " ".join(f"{v * 1e6:8.1f}" for v in t.values())
        print(
            f"{c.spec:36s} {t_copy * 1e6:8.1f} {cells} {t['fused'] / t_copy:8.2f}x "
            f"{t['unfused'] / t_copy:8.2f}x {t['mid_f'] / t['mid_u']:8.2f} {host * 1e6:8.1f}",
            flush=True,
        )
        if differ > 1e-3:
            print(f"  FAIL {c.spec}: fused and unfused middle steps differ in {differ:.2e} of the bytes")
            status = 1
        figures[c.name] = (t["fused"] / t_copy, t["unfused"] / t_copy, t["mid_f"] / t["mid_u"])
    for name, (fc, uc, fu) in figures.items():
        if name in ("taco", "int8-hadamard") or len(figures) <= 2:
            key(f"{name} x copy: fused {fc:.2f}, unfused {uc:.2f} (middle fused/unfused {fu:.2f})")
    return status


# -- step: a generated corpus ----------------------------------------------------------------------
def make_corpus(out_dir: Path, megabytes: float, seed: int = 11, docs: int = 8) -> list[Path]:
    """`docs` .txt files of pseudo-English (a fixed grammar over generated words), `megabytes` in all.

    Deterministic for a seed; has structure at every scale (word spelling, word classes, sentence
    templates, topics per document) so that a small model's loss falls within a few dozen steps.
    """
    rng = random.Random(seed)
    onsets = "b c d f g h l m n p r s t v w br st th ch".split()
    vowels = "a e i o u ai ea ou".split()
    codas = ["", *"n r s t l nd st ck".split()]

    def word(syllables: int) -> str:
        return "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(syllables))

    def words(k: int, lo: int, hi: int) -> list[str]:
        return sorted({word(rng.randint(lo, hi)) for _ in range(k)})

    nouns, verbs, adjs, names = words(400, 1, 3), words(150, 1, 2), words(120, 1, 3), words(60, 2, 3)
    names = [w.capitalize() for w in names]
    templates = [
        "the {a} {n} {v} the {n}.",
        "{N} {v} a {a} {n} and the {n} {v}.",
        "when the {n} {v}, {N} {v} the {a} {n}.",
        "a {n} of {N} is {a}, and the {n} is {a}.",
        "{N} said: the {n} {v} the {a} {n}!",
        "why does the {a} {n} {v} the {n} of {N}?",
    ]
    paths = []
    out_dir.mkdir(parents=True, exist_ok=True)
    per_doc = int(megabytes * 1e6 / docs)
    for d in range(docs):
        topic = rng.sample(nouns, 40)  # each document prefers its own nouns
        parts, size = [f"BOOK {d + 1}\n\n"], 0
        while size < per_doc:
            para = []
            for _ in range(rng.randint(3, 7)):
                t = rng.choice(templates)
                s = t
                for tag, pool in (("{a}", adjs), ("{v}", verbs), ("{N}", names)):
                    while tag in s:
                        s = s.replace(tag, rng.choice(pool), 1)
                while "{n}" in s:
                    s = s.replace("{n}", rng.choice(topic if rng.random() < 0.7 else nouns), 1)
                para.append(s[0].upper() + s[1:])
            text = " ".join(para) + "\n\n"
            parts.append(text)
            size += len(text)
        p = out_dir / f"book{d + 1:02d}.txt"
        p.write_text("".join(parts), encoding="utf-8")
        paths.append(p)
    return paths


def cmd_corpus(args: argparse.Namespace) -> int:
    paths = make_corpus(Path(args.dir), args.mb)
    total = sum(p.stat().st_size for p in paths)
    print(f"wrote {len(paths)} files, {total / 1e6:.2f} MB of generated text, to {args.dir}")
    return 0


# -- step: check a training run --------------------------------------------------------------------
def param_locations(run_dir: Path) -> dict[str, int]:
    """Where the model tensors of the last checkpoint lived when saved: {"cuda:0": count, ...}.

    torch.save records each storage's device; loading with a `map_location` callable sees that tag
    while keeping every storage on the CPU (nothing is moved to a device here).
    """
    import torch

    latest = run_dir / "checkpoints" / "latest"
    if not latest.is_file():
        return {}
    f = latest.parent / latest.read_text().strip() / "rank0.pt"
    tag: dict[int, str] = {}

    def keep(storage, location):
        tag[storage.data_ptr()] = location
        return storage

    state = torch.load(f, map_location=keep, weights_only=False)
    where: dict[str, int] = {}
    for t in state["model"].values():
        if isinstance(t, torch.Tensor) and t.numel():
            loc = tag.get(t.untyped_storage().data_ptr(), "?")
            where[loc] = where.get(loc, 0) + 1
    return where


def cmd_train_check(args: argparse.Namespace) -> int:
    run = Path(args.run_dir)
    status = 0
    recs = []
    metrics = run / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            if line.strip():
                recs.append(json.loads(line))
    losses = [(r["step"], r["loss"]) for r in recs if "loss" in r]
    if len(losses) < 2:
        key(f"no losses in {metrics}")
        return 1
    (s0, l0), (s1, l1) = losses[0], losses[-1]
    falls = math.isfinite(l1) and l1 < l0
    val = [r["val_loss"] for r in recs if "val_loss" in r]
    print(f"loss step {s0}: {l0:.4f} -> step {s1}: {l1:.4f} ({'falls' if falls else 'DOES NOT FALL'})")
    if val:
        print(f"final val loss {val[-1]:.4f}")
    status |= 0 if falls else 1
    summary = {}
    if (run / "summary.json").is_file():
        summary = json.loads((run / "summary.json").read_text())
    tps = summary.get("tokens_per_s", float("nan"))
    print(f"tokens/s {tps:,.0f} (summary.json)")
    where = param_locations(run)
    print(f"checkpoint tensors saved from: {where or 'no checkpoint found'}")
    want = args.device
    on_dev = bool(where) and all(loc.split(":")[0] == want for loc in where)
    if summary.get("device"):
        print(f"summary.json device: {summary['device']}")
    if not on_dev:
        print(f"FAIL: parameters expected on {want}, found {where or 'nothing'}")
        status |= 2
    places = "+".join(sorted(where)) or "?"
    key(f"params on {places}; loss {l0:.2f}->{l1:.2f} ({s1} steps); {tps:,.0f} tok/s")
    return status


# -- main ------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("versions").set_defaults(func=cmd_versions)
    for name, fn in (("bandwidth", cmd_bandwidth), ("host", cmd_host), ("replay", cmd_replay)):
        s = sub.add_parser(name)
        s.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, Triton interpreter")
        s.set_defaults(func=fn)
    s = sub.add_parser("corpus")
    s.add_argument("dir")
    s.add_argument("--mb", type=float, default=1.0, help="megabytes of text")
    s.set_defaults(func=cmd_corpus)
    s = sub.add_parser("train-check")
    s.add_argument("run_dir")
    s.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    s.set_defaults(func=cmd_train_check)
    args = p.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
