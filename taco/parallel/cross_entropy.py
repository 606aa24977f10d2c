"""Cross-entropy over vocabulary-sharded logits (Megatron's vocab-parallel loss).

Logits [b, s, V/tp] never get gathered: three small all-reduces of [b, s] statistics (max, the
target logit, the sum of exponentials) give the exact loss; plain collectives (tiny, and
compressing a max or a log-sum-exp would change the loss itself).

A vocabulary padded so that it shards evenly (`vocab_size` below the logits' width) is masked:
the padded columns are -inf before the softmax, so they take no probability and get no gradient,
and the loss is exactly that of the unpadded model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(fctx, logits, target, group, vocab_size):
        rank = dist.get_rank(group)
        v_local = logits.shape[-1]
        start = rank * v_local
        x = logits.float()  # [b, s, V/tp]
        if vocab_size is not None and start + v_local > vocab_size:  # this shard holds padding
            ids = torch.arange(start, start + v_local, device=x.device)  # [V/tp]
            x = x.masked_fill(ids >= vocab_size, float("-inf"))  # a real logit exists on some rank
        m = x.amax(-1)  # [b, s]
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        x = x - m.unsqueeze(-1)
        outside = (target < start) | (target >= start + v_local)  # [b, s]
        local_t = (target - start).masked_fill(outside, 0)  # [b, s]
        picked = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)  # [b, s]
        e = x.exp()  # [b, s, V/tp]
        sum_e = e.sum(-1)  # [b, s]
        stats = torch.stack((picked, sum_e))
        dist.all_reduce(stats, group=group)
        picked, sum_e = stats[0], stats[1]
        loss = sum_e.log() - picked  # [b, s]
        e.div_(sum_e.unsqueeze(-1))  # softmax
        fctx.save_for_backward(e, local_t, outside)
        fctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(fctx, g):
        softmax, local_t, outside = fctx.saved_tensors
        grad = softmax.clone()
        hit = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -hit)
        return (grad * g.unsqueeze(-1)).to(fctx.dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Per-token loss [b, s] of vocab-sharded logits [b, s, V/tp] (plain CE when tp == 1).

    `vocab_size`: the real vocabulary when the logits carry padding columns (ids >= vocab_size):
    those are left out of the softmax; None = every column is a token.
    """
    if group is None or dist.get_world_size(group) == 1:
        if vocab_size is not None:
            logits = logits[..., :vocab_size]  # [b, s, V]
        return torch.nn.functional.cross_entropy(
            logits.float().flatten(0, -2), target.flatten(), reduction="none"
        ).view(target.shape)
    return _VocabParallelCE.apply(logits, target, group, vocab_size)


def gather_logits(logits: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-gather vocab shards [b, s, V/tp] -> [b, s, V] (evaluation/generation; no gradient)."""
    if group is None or dist.get_world_size(group) == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, dim=-1)
