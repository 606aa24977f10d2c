"""Random weight initialisation shared by the decoders (GPT-2's scheme, used for Qwen too).

Why this file exists: GPT and Qwen start from the same recipe when not loaded from a checkpoint
(nanoGPT, arXiv 2005.14165 appendix): N(0, 0.02) for linears and embeddings, the two residual
projections per block (``attn.out``, ``mlp.down``) scaled by 1/sqrt(2 n_layer), zero biases,
unit norm gains.
"""

from __future__ import annotations

import math

from torch import nn


def init_weights(model: nn.Module, n_layer: int, norms: tuple[type[nn.Module], ...]) -> None:
    """Initialise ``model`` in place; ``norms`` are the norm classes whose weight starts at one."""
    resid_std = 0.02 / math.sqrt(2 * n_layer)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            std = resid_std if name.endswith(("attn.out", "mlp.down")) else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, norms):
            nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
