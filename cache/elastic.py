"""Elastic-Cache (arXiv 2510.14973; spec `dkv_elastic_cache.md` 3.5): attention-aware, layer-wise cache
refresh.

Each step recomputes the tracked tokens T (per layer, the decoded tokens the window attends to most at the
previous step), the tokens decoded at the previous step N, and the window W of the leftmost `window_length`
masked positions; distant masks stay cached. At every layer the attention of T is compared with their
attention at the previous step (from the stored queries and keys); when the similarity falls below `gamma`,
every row is recomputed from the next layer on, starting from the stored layer inputs.

Deviations: the loop's blocks decide what is committed, so W also holds every masked position the sampler
scores this step (with block_length <= window_length W is exactly the reference's); a padded batch switches
at the first layer where any row drifts (the reference runs batch 1); T is de-duplicated against N and W;
pads and masks are never tracked."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from dllm.core.params import param
from dllm.models.sharding import Shard, cosine, ranks_sum
from dllm.models.transformer import Rows, attention_probabilities

from .base import Cache, KVStore, index_rows, predicting_rows, register, row_slots, write_rows, zeros

WINDOW = {"llada": 16, "dream": 32}  # beta of the authors' eval scripts


def attention_drift(before: Tensor, after: Tensor, rows_valid: Tensor, keys_valid: Tensor, axis: str,
                    shard: Shard | None = None) -> Tensor:
    """Elastic-Cache's similarity sigma per batch row: the mean cosine similarity of the tracked rows'
    attention `[B, H, R, Lk]` at the previous and the current step. `axis="keys"` compares each head's
    distribution over the keys (the paper); `"heads"` compares, at each key, the vector over heads (the authors'
    LLaDA and Dream code). Only valid rows `[B, R]` and keys `[B, Lk]` count; NaN for a row with none. On a
    tensor-parallel rank `shard` the heads are its own: the sums run over every rank's."""
    if axis == "keys":
        similarity = F.cosine_similarity(before, after, dim=-1)  # [B, H, R]
        weight = rows_valid[:, None, :].expand_as(similarity).float()
        sums = torch.stack(((similarity * weight).flatten(1).sum(1), weight.flatten(1).sum(1)))
        total, count = ranks_sum(sums, shard)
        return total / count
    similarity = cosine(before, after, 1, shard)  # [B, R, Lk]
    weight = (rows_valid[:, :, None] & keys_valid[:, None, :]).float()
    return (similarity * weight).flatten(1).sum(1) / weight.flatten(1).sum(1)


@register("elastic")
@dataclass
class ElasticCache(Cache):
    """Elastic-Cache: refresh the layers below where the most-attended token's attention drifts.

    Recomputes the most-attended, the just-decoded and the leftmost masked tokens; when the tracked attention
    drifts at a layer, every row from the next layer on."""

    rows_coupled: ClassVar[bool] = True  # the batch switches where any row drifts

    gamma: float = param(0.9, "recompute the deeper layers when the tracked attention similarity falls below this "
                         "(> 1: from layer 1 every step; -inf: never)", allow_inf=True)
    window_length: int | None = param(None, "beta: leftmost masked positions recomputed every step (None: 16 for "
                                      "LLaDA, 32 for Dream, the authors' scripts)", ge=1)
    track_num: int = param(1, "most-attended decoded tokens tracked per layer", ge=1)
    # The authors' LLaDA and Dream code, which produced the published numbers, compares over heads (spec 3.5 [E]);
    # the paper's reading, over keys, is the option.
    drift_axis: str = param("heads", "similarity of each key's attention over heads (authors' code) or of each "
                            "head's attention over keys (paper)", choices=("heads", "keys"))
    force_full_from_layer: int | None = param(None, "also recompute every row from this layer on at every step "
                                              "(0: exactly no cache)", ge=0)

    def new_kv(self, model, batch: int, length: int, allocate=zeros) -> "ElasticStore":
        return ElasticStore(model, batch, length, self, allocate)

    def plan(self, kv, plan):
        """Every row at the first forward; then T, N and W (a full forward when forced from layer 0)."""
        masked = plan.masked
        scored = torch.zeros_like(masked)
        scored[:, plan.lo:plan.hi] = True
        beta = self.window_length or WINDOW[plan.family]
        window = predicting_rows(masked & ((masked.cumsum(1) <= beta) | scored), plan.shift)
        active = None if plan.decoded is None else plan.decoded | kv.tracked.any(0) | window
        return kv.start(plan.canvas, masked, window, active)


class ElasticStore(KVStore):
    """Per layer: post-RoPE K, V and Q and the layer input of every canvas row, and the tokens it tracks."""

    def __init__(self, model, batch: int, length: int, policy: ElasticCache, allocate=zeros):
        cfg, dtype, device = model.config, model.dtype, model.device
        super().__init__(model.kv_shapes(), batch, length, dtype, device, allocate)
        self.policy, self.shard = policy, model.tp
        self.q = [torch.zeros(batch, layer.n_heads, length, layer.head_dim, dtype=dtype, device=device)
                  for layer in model.layers]  # (this rank's heads, tensor parallel)
        self.x = [torch.zeros(batch, length, cfg.hidden_size, dtype=dtype, device=device)
                  for _ in range(cfg.n_layers)]
        self.tracked = torch.zeros(cfg.n_layers, batch, length, dtype=torch.bool, device=device)

    def start(self, canvas, masked: Tensor, window: Tensor, active: Tensor | None) -> Rows:
        """Set up one forward over the `active` rows (None: all) with the window rows `window` `[B, L]`."""
        self.positions, self.masked = canvas.positions, masked
        self.key_mask = canvas.key_mask
        self.keys_valid = torch.ones_like(masked) if canvas.key_mask is None else canvas.key_mask[:, 0, 0]
        self.window, self.tracked_rows = index_rows(window), index_rows(self.tracked.any(0))
        if active is None:
            self.full_from = 0
            return Rows(slice(0, masked.shape[1]))
        forced = self.policy.force_full_from_layer
        self.full_from = len(self.x) if forced is None else forced
        rows = index_rows(active)
        slot = row_slots(rows, 0, masked.shape[1], masked.shape[1], masked.device)
        self.probe = torch.cat((slot.gather(1, self.tracked_rows.index), slot.gather(1, self.window.index)),
                               1).clamp(min=0)
        return rows

    def count(self, rows: int, canvas_rows: int) -> None:
        """Every row from `full_from` on (the layer where this forward grew to the whole canvas, if it did)."""
        self.rows_per_layer = [n + (rows if layer < self.full_from else canvas_rows)
                               for layer, n in enumerate(self.rows_per_layer)]

    def expand(self, layer: int, rows: Rows, x: Tensor) -> tuple[Tensor, Tensor] | None:
        write_rows(self.x[layer], 1, rows, x)
        if rows.is_slice or layer < self.full_from:
            return None
        return self.x[layer], self.positions

    def update(self, layer: int, rows: Rows, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if not rows.is_slice and self.tracked_rows.index.shape[1]:  # their attention at the last step
            index = self.tracked_rows.index[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[-1])
            self.past = attention_probabilities(self.q[layer].gather(2, index), self.k[layer], self.key_mask)
        write_rows(self.q[layer], 2, rows, q)
        return super().update(layer, rows, q, k, v)

    def attention_rows(self, layer: int, rows: Rows) -> Tensor:
        """[T ; W] among the active rows; only W once every row is computed (no drift test there)."""
        return self.window.index if rows.is_slice else self.probe

    def observe_attention(self, layer: int, rows: Rows, probs: Tensor) -> None:
        tracked = 0 if rows.is_slice else self.tracked_rows.index.shape[1]
        if tracked:
            sigma = attention_drift(self.past, probs[:, :, :tracked], self.tracked_rows.valid, self.keys_valid,
                                    self.policy.drift_axis, self.shard)
            if (sigma < self.policy.gamma).any():
                self.full_from = min(self.full_from, layer + 1)
        received = ranks_sum((probs[:, :, tracked:] * self.window.valid[:, None, :, None]).sum((1, 2)), self.shard)
        received = received.masked_fill(self.masked | ~self.keys_valid, float("-inf"))
        top = received.topk(min(self.policy.track_num, received.shape[1]), dim=1)
        self.tracked[layer] = torch.zeros_like(self.masked).scatter(1, top.indices, top.values > float("-inf"))

    @property
    def nbytes(self) -> int:
        return super().nbytes + sum(t.numel() * t.element_size() for t in self.q + self.x)
