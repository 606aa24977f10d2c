"""Cross-entropy over vocabulary-sharded logits (Megatron's vocab-parallel loss), lean.

Logits [b, s, V/tp] never get gathered. Each rank reduces its shard to three numbers per token:
its max m_r, its sum of exponentials s_r = sum exp(x - m_r) and the target's logit t_r (0 where
the target lives on another rank). ONE all-gather of those [3, b*s] statistics gives every rank
the exact log-sum-exp, M = max_r m_r, S = sum_r s_r exp(m_r - M), and the loss
log S + M - sum_r t_r: one small collective per loss where the textbook form takes two
(a max, then a sum). Plain collectives: compressing a max or a log-sum-exp would change the loss.

Memory: one full-size fp32 buffer, the shard as fp32, turned into the softmax in place
(subtract, exp, scale) and saved for the backward, which turns it into the gradient in place
(softmax - one-hot, times the incoming gradient) and casts it to the logits' dtype. Like
Megatron's loss, the backward consumes its saved buffer, so it runs once per forward.

A vocabulary padded so that it shards evenly (`vocab_size` below the logits' width) is masked:
the padded columns are -inf before the softmax, so they take no probability and get no gradient,
and the loss is exactly that of the unpadded model (a shard of padding only contributes s_r = 0).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _gather_stats(stats: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[3, n] per rank -> [tp, 3, n], one all-gather (rank order)."""
    out = stats.new_empty(dist.get_world_size(group) * stats.numel())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # newer torch: renamed
    gather(out, stats.contiguous().view(-1), group=group)
    return out.view(-1, *stats.shape)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(fctx, logits, target, group, vocab_size):
        rank = dist.get_rank(group)
        v_local = logits.shape[-1]
        start = rank * v_local
        # the one full-size fp32 buffer: a copy even when the logits are fp32 (they stay intact)
        x = logits.to(torch.float32, copy=True)  # [b, s, V/tp]
        if vocab_size is not None and start + v_local > vocab_size:  # this shard holds padding
            x[..., max(vocab_size - start, 0) :] = float("-inf")
        outside = (target < start) | (target >= start + v_local)  # [b, s]
        local_t = (target - start).masked_fill(outside, 0)  # [b, s]
        t = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)  # [b, s]
        m = x.amax(-1)  # [b, s]; -inf on a row of padding only
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # keeps padding rows NaN-free
        x.sub_(m_safe.unsqueeze(-1)).exp_()  # exp(x - m_r), in place
        s = x.sum(-1)  # [b, s]
        every = _gather_stats(torch.stack((m, s, t)).flatten(1), group)  # [tp, 3, b*s]
        m_all, s_all = every[:, 0], every[:, 1]
        big_m = m_all.amax(0)  # [b*s], finite: a real logit exists on some rank
        w = torch.exp(m_all - big_m)  # [tp, b*s]; 0 for a shard of padding (m_r = -inf)
        total = (s_all * w).sum(0)  # [b*s]
        loss = total.log() + big_m - every[:, 2].sum(0)  # [b*s]
        x.mul_((w[rank] / total).view(m.shape).unsqueeze(-1))  # the softmax, in place
        fctx.save_for_backward(x, local_t, outside)
        fctx.dtype = logits.dtype
        fctx.used = False
        return loss.view(target.shape)

    @staticmethod
    def backward(fctx, g):
        if fctx.used:
            raise RuntimeError("vocab_parallel_cross_entropy: the backward runs once (it reuses its buffer)")
        fctx.used = True
        grad, local_t, outside = fctx.saved_tensors  # softmax [b, s, V/tp], consumed here
        hit = (~outside).to(grad.dtype).unsqueeze(-1)  # [b, s, 1]
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -hit)  # softmax - one-hot
        grad.mul_(g.unsqueeze(-1))
        return grad.to(fctx.dtype), None, None, None


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
