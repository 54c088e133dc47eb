"""d2Cache's certainty-prior decoding (Jiang et al., *d2Cache: Accelerating Diffusion-Based LLMs via Dual Adaptive
Caching*, arXiv 2509.23094; Kamichanw/d2Cache `src/generation/vanilla.py`, spec `strategies_2026.md` section 5a):
a masked position's confidence times the certainty density of the decoded positions around it, so decoding
spreads outward from what is already decoded (smaller sigma: closer to left-to-right). With `cache="d2cache"`
the authors decode one token per step (steps = gen_length) over one block (block_length = gen_length).

Differences from the authors' code: the confidence is the softmax in float32 (theirs in the logits' type, bf16
on their models); at a temperature the token is drawn by Gumbel-argmax from the row's own generator (theirs by
`Categorical`), scored, as theirs, by its tempered probability."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import ClassVar

from dllm.core.density import certainty_density
from dllm.core.params import param

from .base import (Commit, Sampler, StepContext, each_value, gumbel_argmax, quota, register, tempered,
                   token_probability, top_k_per_row)
from .fastdllm import threshold_commit


@register("certainty_prior")
@dataclass
class CertaintyPrior(Sampler):
    """d2Cache's certainty prior: commit by confidence times the density of decoded positions around each one.

    The scheduled count per step (steps = gen_length: one), or with `threshold` every position whose score
    reaches it (and the best)."""

    reads_shards: ClassVar[bool] = True
    block_local: ClassVar[bool] = False  # the density spans the whole answer

    sigma: float = param(10.0, "std of the Gaussian density over decoded positions (d2Cache: 10; smaller: closer to "
                               "left-to-right)", gt=0.0)
    threshold: float | None = param(None, "commit every position whose confidence x density reaches this, and "
                                          "always the best (None: the scheduled count)", ge=0.0)

    def step(self, ctx: StepContext) -> Commit:
        tokens = gumbel_argmax(ctx.logits, self.temperature, ctx.generators)
        confidence = token_probability(tempered(ctx.logits.float(), self.temperature), tokens, ctx.unscored)
        decoded = ctx.canvas[:, ctx.prompt_length:] != ctx.config.mask_id
        density = each_value(self.sigma, partial(certainty_density, decoded))
        score = confidence * density[:, ctx.positions - ctx.prompt_length]
        mask = each_value(self.threshold, lambda threshold: top_k_per_row(score, ctx.eligible, quota(ctx))
                          if threshold is None else threshold_commit(score, ctx.eligible, threshold))
        return Commit(mask, tokens, score)
