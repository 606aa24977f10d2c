"""A bandwidth-limited network for benchmarks: a Linux network namespace whose loopback is capped.

Why this file exists: on one machine, ranks talk over `lo` at memory speed, so compression can
only look slower. The emulation (docs/design.md 3, end-to-end) runs the ranks inside a fresh network
namespace whose `lo` is shaped by `tc` (token bucket, optionally a netem delay), so every byte the
ranks exchange crosses a link of known rate. Note: all ranks share that one `lo`, so the cap is
the aggregate rate of all ranks' traffic (a shared bus, not one link per rank).

    with NetNamespace(rate_mbit=100) as ns:
        subprocess.run(ns.command([sys.executable, "-m", "taco.bench.comm", ...]), check=True)

The namespace is always deleted: on exit of the `with`, at interpreter exit, and on SIGTERM.
Needs root (CAP_NET_ADMIN) and iproute2; without them entering raises `BenchError` saying so.
Also a command line: `python -m taco.bench.netns --rate 100 -- CMD ARGS...` runs CMD capped.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from types import FrameType

from . import BenchError

ROOT = Path(__file__).resolve().parents[2]
"""the checkout this taco is imported from (its configs/, and PYTHONPATH of re-executed children)"""


def _sh(*argv: str) -> None:
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({r.returncode}): {r.stderr.strip()}")


def require_root() -> None:
    """Raise `BenchError` with a clear message unless we can create namespaces and shape traffic."""
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        raise BenchError(f"{', '.join(missing)} not found: install iproute2")
    if os.geteuid() != 0:
        raise BenchError(
            "creating a network namespace and capping it with tc needs root "
            "(CAP_NET_ADMIN); rerun with sudo, or drop the rate option to run on the host's lo"
        )


def child_env() -> dict[str, str]:
    """The environment for `python -m taco...` re-executed inside a namespace: this checkout first on
    PYTHONPATH (the child imports the same taco), c10d's warning about the missing hostname entry off."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return env


class NetNamespace:
    """Context manager: `ip netns add`, lo up, `tc` cap on lo; `ip netns delete` always.

    rate_mbit: token-bucket rate of lo; burst: bucket size (tc syntax, must exceed one packet:
    lo's MTU is 64 KiB); latency: most time a packet may wait in the bucket (tc syntax);
    delay_ms: optional netem delay added in front of the bucket (needs the sch_netem kernel
    module; some VM kernels lack it and `tc` then fails with "Specified qdisc kind is unknown").
    """

    def __init__(
        self,
        rate_mbit: float,
        burst: str = "256kb",
        latency: str = "400ms",
        delay_ms: float = 0.0,
        name: str | None = None,
    ) -> None:
        if not rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0, got {rate_mbit}")
        self.rate_mbit = float(rate_mbit)
        self.burst, self.latency, self.delay_ms = burst, latency, float(delay_ms)
        self.name = name or f"taco-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._created = False
        self._old_term: object = None

    def describe(self) -> str:
        d = f", netem delay {self.delay_ms:g} ms" if self.delay_ms else ""
        rate = f"{self.rate_mbit:g} Mbit/s"
        return f"netns {self.name}: lo tbf rate {rate} burst {self.burst} latency {self.latency}{d}"

    def __enter__(self) -> NetNamespace:
        require_root()
        atexit.register(self.delete)
        self._old_term = signal.signal(signal.SIGTERM, self._on_term)
        _sh("ip", "netns", "add", self.name)
        self._created = True
        try:
            _sh("ip", "-n", self.name, "link", "set", "lo", "up")
            tbf = ["tbf", "rate", f"{self.rate_mbit:g}mbit", "burst", self.burst, "latency", self.latency]
            tc = ("ip", "netns", "exec", self.name, "tc", "qdisc", "add", "dev", "lo")
            if self.delay_ms:
                try:
                    _sh(*tc, "root", "handle", "1:", "netem", "delay", f"{self.delay_ms:g}ms")
                except RuntimeError as e:
                    raise RuntimeError(f"{e}: a delay needs the sch_netem kernel module (modprobe "
                                       "sch_netem); without it use a delay of 0") from None  # fmt: skip
                _sh(*tc, "parent", "1:1", "handle", "10:", *tbf)
            else:
                _sh(*tc, "root", *tbf)
        except BaseException:
            self.delete()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.delete()

    def delete(self) -> None:
        """Delete the namespace (idempotent; safe from atexit and signal handlers)."""
        if self._created:
            self._created = False
            subprocess.run(["ip", "netns", "delete", self.name], capture_output=True)
        atexit.unregister(self.delete)
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None

    def _on_term(self, signum: int, frame: FrameType | None) -> None:
        # Process control, not an error: installed only while this process holds the namespace, it
        # deletes it and then ends the process as SIGTERM would (status 128 + 15), by unwinding, so
        # the callers' `finally` blocks (e.g. killing the worker's process group) still run.
        self.delete()
        raise SystemExit(128 + signum)

    def command(self, argv: list[str]) -> list[str]:
        """argv prefixed to run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def qdisc_stats(self) -> str:
        """`tc -s qdisc show dev lo` inside the namespace (bytes sent, drops, overlimits)."""
        r = subprocess.run(
            self.command(["tc", "-s", "qdisc", "show", "dev", "lo"]), capture_output=True, text=True
        )
        return r.stdout.strip()

    def exists(self) -> bool:
        r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
        return any(line.split()[0] == self.name for line in r.stdout.splitlines() if line.strip())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m taco.bench.netns", description=__doc__.split("\n")[0])
    p.add_argument("--rate", type=float, required=True, help="lo rate in Mbit/s")
    p.add_argument("--burst", default="256kb", help="token bucket size (tc syntax)")
    p.add_argument("--latency", default="400ms", help="tbf latency (tc syntax)")
    p.add_argument("--delay", type=float, default=0.0, help="netem delay in ms (0: none)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command to run inside")
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("give a command after --")
    with NetNamespace(args.rate, args.burst, args.latency, args.delay) as ns:
        print(ns.describe(), file=sys.stderr)
        return subprocess.run(ns.command(cmd)).returncode


if __name__ == "__main__":  # errors become one line and an exit code as for `taco` (taco.cli)
    from taco.cli import run_command

    sys.exit(run_command("taco.bench.netns", "bench", main))
