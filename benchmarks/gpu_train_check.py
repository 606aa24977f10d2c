"""Steps `corpus` and `train-check` of `benchmarks/gpu_check.py`: offline data for the trainer smoke run,
and the checks of that run (parameters on the device, loss falling, tok/s)."""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

from gpu_common import key


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
