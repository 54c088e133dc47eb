"""d2Cache (Jiang et al., *d2Cache: Accelerating Diffusion-Based LLMs via Dual Adaptive Caching*, ICLR 2026, arXiv
2509.23094; Kamichanw/d2Cache `src/cache/d2cache.py`; spec `strategies_2026.md` section 5b).

The first forward computes every row. After each step the rows of the next forward are chosen: the `current_k`
masked positions with the best first-forward confidence C times the certainty density D (`dllm.core.density`),
searched from the block start up to the block end past the k-th mask, those in the block first (on Dream the
rows before them, which predict them); every position committed at the step; then, of the other rows, the
nucleus (`rollout_p`) by attention-rollout importance: per layer the head-mean attention A of the computed rows
(identity rows for the others), R <- rownorm(A + I) R from R = I, importance of row j = sum_i R_ij. Optional:
gaps of at most `inflate_w` between chosen rows are filled. Nothing is refreshed periodically or at a block start;
rows not computed predict nothing (zero logits).

Reproduced quirks of the authors' code: C stays the first forward's confidences (their update writes into a copy;
`refresh_confidence` does what it means); the plan after a block's last step is made with that block (their
`on_step_end`), so its in-block boost goes to the finished block; masked positions whose rows were not computed
stay eligible with zero logits (their restriction of the candidates to computed rows also writes into a copy):
the sampler commits one only when no computed row is eligible (possible when `current_k` > `block_length`, at the
first step of a block); `top_up` makes every row of a batch compute as many rows.

Deviations: the in-block boost is each row's own maximum score (theirs the batch's; the same for one row);
padding rows are never chosen (theirs can be, by importance); the rollout is kept in float32 (theirs in the model's
type); C is the greedy confidence (max probability, MASK excluded; theirs their sampler's, the same at temperature 0
without top-p)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from dllm.core.density import certainty_density
from dllm.core.params import param
from dllm.models.sharded_logits import ShardedLogits, set_column
from dllm.models.sharding import head_mean
from dllm.models.transformer import Rows, canvas_index, head

from .base import Cache, KVStore, index_rows, register, write_rows, zeros


@register("d2cache")
@dataclass
class D2Cache(Cache):
    """d2Cache (arXiv 2509.23094): recompute the likeliest next masks, the new tokens and the most attended other rows.

    Masks by first-step confidence x certainty density, other rows by attention rollout; no refresh. The authors
    decode with it one token per step over one block (`--sampler certainty_prior`, block_length = gen_length)."""

    reads_model_outputs: ClassVar[bool] = True

    current_k: int = param(32, "masked positions recomputed each step, by confidence x certainty density", ge=1)
    rollout_p: float = param(0.1, "nucleus of the other rows by attention-rollout importance recomputed each step "
                                  "(at least one)", ge=0.0, le=1.0)
    sigma: float = param(10.0, "std of the certainty density that ranks the masked positions", gt=0.0)
    inflate_w: int = param(0, "also recompute the rows between two chosen rows at most this far apart (the authors' "
                              "settings: 0; their class default 4, for blocks)", ge=0)
    refresh_confidence: bool = param(False, "update a position's confidence wherever a forward predicts it (what the "
                                            "authors' code means to do; theirs stays the first forward's)")
    top_up: bool = param(True, "every row of a batch computes as many rows, topped up by density then importance "
                               "(the authors'); False: a padded row decodes as its prompt alone")

    @property
    def rows_coupled(self) -> bool:
        return self.top_up

    def new_kv(self, model, batch: int, length: int, allocate=zeros) -> "D2Store":
        return D2Store(model, batch, length, self, allocate)

    def plan(self, kv: "D2Store", plan) -> Rows:
        """Every row at the first forward; then the rows chosen after the last step (module docstring)."""
        block = kv.start(plan)
        if plan.decoded is None:
            return Rows(slice(0, plan.masked.shape[1]))
        start, length = plan.canvas.prompt_length, plan.masked.shape[1]
        key_mask = plan.canvas.key_mask
        real = torch.ones_like(plan.masked) if key_mask is None else key_mask[:, 0, 0]
        remaining = plan.masked[:, start:]
        scores, selected = self.likeliest_masks(kv.confidence[:, start:], remaining, block[0] - start,
                                                block[1] - block[0])
        rows = F.pad(selected[:, 1:], (0, 1)) if plan.shift else selected.clone()  # Dream: the predicting rows
        rows |= plan.decoded[:, start:]
        rows = F.pad(rows, (start, 0))
        importance = kv.rollout.sum(1)
        rows |= nucleus(importance, self.rollout_p, ~rows & real)
        if plan.shift:
            rows[:, start - 1] = selected[:, 0]  # the last prompt row predicts the first answer position
        if self.inflate_w:
            rows |= inflated(rows, self.inflate_w)
        if self.top_up:
            top_up(rows, importance, scores, real)
        return index_rows(rows)

    def likeliest_masks(self, confidence: Tensor, remaining: Tensor, block_start: int, block_size: int
                        ) -> tuple[Tensor, Tensor]:
        """The `[B, G]` scores C x D (+ the row's best inside the block) and the up to `current_k` best masked
        positions, searched from the block start to the end of the block holding the k-th mask."""
        width = remaining.shape[1]
        column = torch.arange(width, device=remaining.device)
        reached = remaining.int().cumsum(1) >= self.current_k
        last = torch.where(reached.any(1, keepdim=True), reached.int().argmax(1, keepdim=True), width - 1)
        search = (column >= block_start) & (column <= (last // block_size + 1) * block_size - 1)
        scores = confidence * certainty_density(~remaining, self.sigma)
        in_block = (column >= block_start) & (column < block_start + block_size)
        scores = torch.where(in_block, scores + scores.amax(1, keepdim=True), scores)
        best = torch.where(search & remaining, scores, float("-inf")).topk(min(self.current_k, width), dim=1).indices
        return scores, torch.zeros_like(remaining).scatter(1, best, True) & remaining


def nucleus(importance: Tensor, p: float, available: Tensor) -> Tensor:
    """`[B, L]`: the most important `available` rows whose normalized importance sums to at most `p`, and at least
    the most important one (the authors' `nucleus_select` with min_k 1)."""
    importance = torch.where(available, importance, 0.0)
    share = importance / (importance.sum(-1, keepdim=True) + 1e-9)
    ranked, order = share.sort(-1, descending=True)
    keep = ranked.cumsum(-1) <= p
    keep[:, 0] = True
    return torch.zeros_like(available).scatter(1, order, keep & available.gather(1, order))


def inflated(rows: Tensor, width: int) -> Tensor:
    """`[B, L]`: the rows lying between two chosen `rows` at most `width` apart."""
    length = rows.shape[1]
    column = torch.arange(length, device=rows.device).expand_as(rows)
    after = torch.where(rows, column, length).flip(-1).cummin(-1).values.flip(-1)  # the next chosen row, or L
    before = torch.where(rows, column, -1).cummax(-1).values  # the previous chosen row, or -1
    return (after - before <= width) & (before >= 0) & (after < length)


def top_up(rows: Tensor, importance: Tensor, scores: Tensor, real: Tensor) -> None:
    """Give every batch row as many chosen rows as the most any has (the authors' `top_up_mask`): the answer rows
    first, by `scores` `[B, G]`, then the others by importance; in place."""
    count = rows.sum(1)
    target = int(count.max())
    if bool((count == target).all()):
        return
    ranked = torch.where(rows | ~real, float("-inf"), importance)
    answer = ranked[:, -scores.shape[1]:]
    ranked[:, -scores.shape[1]:] = answer + (ranked.max() + scores)
    best = ranked.topk(target - int(count.min()), dim=1)
    wanted = (torch.arange(best.indices.shape[1], device=rows.device) < (target - count)[:, None]) & \
        (best.values > float("-inf"))  # never a padding row
    rows.scatter_(1, best.indices, wanted | rows.gather(1, best.indices))


class D2Store(KVStore):
    """The K/V store with d2Cache's state: the attention rollout of the forward `rollout` `[B, L, L]`, the
    confidences C `[B, L]` (the answer's columns), the block of the last plan."""

    def __init__(self, model, batch: int, length: int, policy: D2Cache, allocate=zeros):
        super().__init__(model.kv_shapes(), batch, length, model.dtype, model.device, allocate)
        self.model, self.policy = model, policy
        self.rollout = torch.zeros(batch, length, length, device=model.device)
        self.confidence = torch.zeros(batch, length, device=model.device)
        self.block: tuple[int, int] | None = None
        self.first = True  # the next forward is the first

    def start(self, plan) -> tuple[int, int]:
        """Note the forward `plan` (a `PlanContext`) describes; returns the block of the step that ended (at the
        first forward, this one's): the authors plan at the end of a step, with its block."""
        block = self.block or (plan.start, plan.end)
        self.block, self.masked, self.shift = (plan.start, plan.end), plan.masked, plan.shift
        self.gen_start = plan.canvas.prompt_length
        return block

    def attention_rows(self, layer: int, rows: Rows) -> Tensor:
        """Every computed row."""
        count = len(range(self.rollout.shape[1])[rows.index]) if rows.is_slice else rows.index.shape[1]
        return torch.arange(count, device=self.rollout.device).expand(self.rollout.shape[0], -1)

    def observe_attention(self, layer: int, rows: Rows, probs: Tensor) -> None:
        """One rollout step: the computed rows of R become rownorm(head-mean attention + I) R."""
        batch, length = self.rollout.shape[:2]
        if layer == 0:
            self.rollout = torch.eye(length, device=probs.device).expand(batch, -1, -1).clone()
        index = canvas_index(rows, self.attention_rows(layer, rows))
        mixed = head_mean(probs, self.model.tp).scatter_add(2, index[..., None], torch.ones_like(index[..., None], dtype=probs.dtype))
        mixed = mixed / mixed.sum(-1, keepdim=True)
        write_rows(self.rollout, 1, rows if not rows.is_slice else Rows(index), mixed @ self.rollout)

    def observe_output(self, rows: Rows, x: Tensor) -> None:
        """C of every answer position at the first forward; with `refresh_confidence`, again wherever a forward
        predicts a position still masked when it was planned."""
        start, shift, length = self.gen_start, self.shift, self.masked.shape[1]
        if self.first:
            self.first = False
            self.confidence[:, start:] = self.greedy_confidence(x[:, start - shift:length - shift])
            return
        if not self.policy.refresh_confidence:
            return
        index = canvas_index(rows, torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1))
        target = (index + shift).clamp(max=length - 1)
        fresh = (index + shift < length) & (target >= start) & self.masked.gather(1, target)
        if rows.valid is not None:
            fresh &= rows.valid
        kept = self.confidence.gather(1, target)
        self.confidence.scatter_(1, target, torch.where(fresh, self.greedy_confidence(x), kept))

    def greedy_confidence(self, hidden: Tensor) -> Tensor:
        """The largest probability (MASK excluded) of the predictions of final hidden states `[B, A, d]`."""
        logits = head(self.model.norm(hidden), self.model.lm_head.weight).float()
        set_column(logits, self.model.config.mask_id, float("-inf"), self.model.tp)
        if self.model.tp is not None:
            return ShardedLogits(logits, self.model.tp).max_probability()
        return logits.softmax(-1).amax(-1)

    @property
    def nbytes(self) -> int:
        return super().nbytes + sum(t.numel() * t.element_size() for t in (self.rollout, self.confidence))
