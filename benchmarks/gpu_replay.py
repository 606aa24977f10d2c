"""Step `replay` of `benchmarks/gpu_check.py`: one rank of an N=8 two-shot all-reduce, fused and unfused,
against a device-to-device copy of the message."""

from __future__ import annotations

import argparse
import statistics

from gpu_common import MIB, Timer, key, need_codecs, pick_device, size_str


# -- step: all-reduce replay -----------------------------------------------------------------------
class RankReplay:
    """What one rank of an N-rank two-shot all-reduce computes (taco.comm.compressed), no transfer.

    The message is cut into N chunks (`split_sizes`, whole codec groups); this is rank `rank`:
    encode:  the N-1 chunks of the other ranks into the all-to-all send buffer: one
             `codec.encode_chunks` (fused) or one `codec.encode` per chunk (unfused);
    middle:  the N-1 received wire chunks of its own chunk + its own raw values -> fp32 sum in rank
             order -> encode, fused (`codec.decode_sum_encode`, what `AllReduceSlice.reduce` runs)
             or unfused (decode each to fp32, add, encode);
    finish:  decode the N wire chunks of the all-gather (own included) into the output: one
             `codec.decode_chunks` straight into it (fused) or one decode per chunk (unfused).
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

    def encode_fused(self) -> None:
        others = [j for j in range(self.nway) if j != self.rank]
        spans = [(j * self.m, self.m, k * self.nb) for k, j in enumerate(others)]
        self.c.encode_chunks(self.x, self.send, spans)

    def encode(self) -> None:
        c, k = self.c, 0
        for j in range(self.nway):
            if j != self.rank:
                c.encode(self.chunk(self.x, j), out=self.send[k * self.nb : (k + 1) * self.nb])
                k += 1

    def middle_fused(self) -> None:
        own = self.chunk(self.x, self.rank)
        self.c.decode_sum_encode(
            self.recv, self.nb, self.nway - 1, self.m, self.torch.bfloat16, own=own, own_index=self.rank,
            out=self.ag_send,
        )  # fmt: skip

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

    def finish_fused(self) -> None:
        spans = [(j * self.m, self.m, j * self.nb) for j in range(self.nway)]
        self.c.decode_chunks(self.ag_recv, self.dst, spans)

    def fused(self) -> None:
        self.encode_fused()
        self.middle_fused()
        self.finish_fused()

    def unfused(self) -> None:
        self.encode()
        self.middle_unfused()
        self.finish()

    def agreement(self) -> tuple[float, float, float]:
        """(fraction of wire bytes where the fused and unfused middle steps differ, SQNR of each
        against the fp32 sum of the decoded terms). Bytes may differ where the two sum the same
        terms with other roundings (FMA contraction, the rotation's order: a code or a scale moves
        by one step or ulp); the fidelity may not."""
        torch, c, m = self.torch, self.c, self.m
        self.middle_fused()
        a = self.ag_send.clone()
        self.middle_unfused()
        b = self.ag_send.clone()
        acc = self.chunk(self.x, self.rank).float()
        for j in range(self.nway):
            if j != self.rank:
                o = (j - (j > self.rank)) * self.nb
                acc = acc + c.decode(c.wrap(self.recv[o : o + self.nb], (m,), torch.bfloat16)).float()

        def sqnr(buf) -> float:
            y = c.decode(c.wrap(buf, (m,), torch.bfloat16)).double()
            return (10 * torch.log10(acc.double().pow(2).sum() / (acc.double() - y).pow(2).sum())).item()

        return (a != b).float().mean().item(), sqnr(a), sqnr(b)


def cmd_replay(args: argparse.Namespace) -> int:
    import torch

    dev = pick_device(args.dry_run)
    codecs = need_codecs(dev, args.dry_run)
    nway, rank = 8, 0
    mib = 1 / 256 if args.dry_run else 64
    n = int(mib * MIB) // 2
    timer = Timer(dev, reps=1, inner=1, warmup=0) if args.dry_run else Timer(dev, reps=5, inner=3)
    print(
        f"one rank (rank {rank}) of an N={nway} two-shot all-reduce of a {size_str(mib)} bf16 message, "
        "computation only (no transfer);\n"
        f"encode = {nway - 1} chunks (one call fused); middle = decode-sum-encode of {nway} terms "
        f"({nway - 1} received + own) fused in one kernel, or unfused (decode each in fp32, add, "
        f"encode);\nfinish = {nway} chunk decodes (fused: one call straight into the output); times in us "
        "(GPU time back to back) and as a "
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
        differ, db_fused, db_unfused = r.agreement()
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
        if abs(db_fused - db_unfused) > 0.05:
            print(f"  FAIL {c.spec}: fused middle step {db_fused:.2f} dB, unfused {db_unfused:.2f} dB")
            status = 1
        elif differ:
            print(f"  {c.spec}: {differ:.2e} of the middle step's bytes differ (one step or ulp), "
                  f"{db_fused:.2f} dB fused, {db_unfused:.2f} dB unfused")
        figures[c.name] = (t["fused"] / t_copy, t["unfused"] / t_copy, t["mid_f"] / t["mid_u"])
    for name, (fc, uc, fu) in figures.items():
        if name in ("taco", "int8-hadamard") or len(figures) <= 2:
            key(f"{name} x copy: fused {fc:.2f}, unfused {uc:.2f} (middle fused/unfused {fu:.2f})")
    return status
