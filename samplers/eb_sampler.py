"""EB-Sampler (spec `strategies_2026.md` section 4): entropy-bounded unmasking."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from dllm.core.params import param

from .base import (Commit, Sampler, StepContext, entropy_bounded, gumbel_argmax, register, token_entropy,
                   token_probability)


@register("eb_sampler")
@dataclass
class EBSampler(Sampler):
    """EB-Sampler (Ben-Hamu et al., arXiv 2505.24857; no official code): each step commits the block's masked
    positions of lowest entropy, as many as keep the sum of their entropies less the largest within gamma (at least
    one), so the number per step adapts to how sure the model is.

    The defaults are NEUIR/PC-Sampler's port (`generate_with_eb_sampler`: gamma 0.01 nats, ranked by entropy, the
    answer as one block: block_length = gen_length). `unit="bits"`, gamma 1.0 in blocks is omerlux/DUS's
    `generate_eb_sampler` (which also caps a block at steps / blocks forwards, leaving masks when that binds; here
    a block runs until it is decoded, as there with steps = gen_length); `order="confidence"` is Kamichanw/d2Cache's
    `confidence_unmasking(gamma)` (ranked by confidence; its maximum over the batch axis makes the test the
    entropies ranked before a position, per row here). Entropies are in float32 from the model's logits (at T > 0
    the ports differ: DUS's from the noisy logits, d2Cache's from the tempered ones)."""

    reads_shards: ClassVar[bool] = True
    orders_by_token_probability: ClassVar[bool] = False  # the count comes from entropies
    canvas_may_grow: ClassVar[bool] = True

    gamma: float = param(0.01, "commit while the entropies of the positions ranked before sum to at most this "
                               "(PC-Sampler: 0.01 nats; DUS: 1.0 bits)", ge=0.0)
    unit: str = param("nats", "unit of the entropies and gamma", choices=("nats", "bits"))
    order: str = param("entropy", "rank masked positions by lowest entropy (the paper) or highest confidence "
                                  "(d2Cache's port)", choices=("entropy", "confidence"))

    def step(self, ctx: StepContext) -> Commit:
        tokens = gumbel_argmax(ctx.logits, self.temperature, ctx.generators)
        confidence = token_probability(ctx.logits, tokens)
        entropy = token_entropy(ctx.logits)
        if self.unit == "bits":
            entropy = entropy / math.log(2)
        score = confidence if self.order == "confidence" else None
        return Commit(entropy_bounded(entropy, ctx.eligible, self.gamma, score), tokens, confidence)
