"""dLLM-Cache (Liu et al., *dLLM-Cache: Accelerating Diffusion Large Language Models with Adaptive Caching*, arXiv
2506.06295; maomaocun/dLLM-cache `dllm_cache/hooks/cache_hook_LLaDA.py`, `cache_hook_Dream.py`, `cache/Cache.py`;
spec `strategies_2026.md` section 6).

Every row's hidden state goes through every layer, but a layer computes attention and feed-forward only for some
rows; the others add the attention and feed-forward outputs the layer last computed for them. At forward n
(from 1, per generation) the prompt rows are computed iff (n - 1) mod Kp = 0, the answer rows iff (n - 1) mod Kr = 0,
and layer 0 always computes every row. In between (V-verify, `transfer_ratio` > 0), each layer projects the values
of every answer row from its input, stores them all, and computes the int(G x ratio) answer rows whose values are
least cosine-similar to the stored ones (G answer rows); their keys are stored, the others' stay.

Deviations: padding is masked and each row's RoPE position is its own (the authors' hook passes no attention
mask and counts positions from the canvas's first column; the same without padding); the guidance residual cache
(`cfg_interval_steps`) is not kept: with cfg_scale every forward computes the unconditional rows beside their rows,
each with its own features."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from dllm.core.params import param
from dllm.models.sharding import cosine
from dllm.models.transformer import Rows

from .base import Cache, KVStore, register, zeros


@register("dllm_cache")
@dataclass
class DllmCache(Cache):
    """dLLM-Cache (arXiv 2506.06295): reuse each layer's attention and feed-forward outputs; refresh prompt and
    answer at intervals.

    In between, each layer recomputes the answer rows whose values moved most (V-verify). Kp = Kr = 1 is no cache."""

    covers_window: ClassVar[bool] = True  # every row's hidden state goes through every layer

    prompt_interval: int = param(100, "Kp: compute the prompt rows every Kp forwards (the authors' demo: 100)", ge=1)
    response_interval: int = param(7, "Kr: compute every answer row every Kr forwards (the authors' demo: 7)", ge=1)
    transfer_ratio: float = param(0.25, "rho: between answer refreshes, each layer computes this share of the answer "
                                        "rows, those whose values moved most (0: none)", ge=0.0, le=1.0)

    def new_kv(self, model, batch: int, length: int, allocate=zeros) -> "DllmStore":
        return DllmStore(model, batch, length, self, allocate)

    def plan(self, kv: "DllmStore", plan) -> Rows:
        """Every row: the layers choose (`DllmStore.layer_rows`)."""
        kv.start(plan.canvas.prompt_length)
        return Rows(slice(0, plan.masked.shape[1]))


class DllmStore(KVStore):
    """K/V and, per layer, every row's last attention-branch output `attended[layer]` and feed-forward-branch output
    `fed[layer]` `[B, L, d]`."""

    def __init__(self, model, batch: int, length: int, policy: DllmCache, allocate=zeros):
        super().__init__(model.kv_shapes(), batch, length, model.dtype, model.device, allocate)
        self.model, self.policy = model, policy
        shape, layers = (batch, length, model.config.hidden_size), model.config.n_layers
        self.attended = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(layers)]
        self.fed = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(layers)]
        self.forwards = 0
        self.counted = [0] * layers  # rows through each layer in this forward (batch summed)
        self.verified: Tensor | None = None  # the answer rows' values of this layer's V-verify

    def start(self, gen_start: int) -> None:
        self.forwards += 1
        self.gen_start = gen_start
        self.refresh_prompt = (self.forwards - 1) % self.policy.prompt_interval == 0
        self.refresh_answer = (self.forwards - 1) % self.policy.response_interval == 0

    def layer_rows(self, layer: int, rows: Rows, x: Tensor) -> Tensor:
        """Every row, the answer rows, or the prompt rows (if refreshed) and the answer rows V-verify picks."""
        batch, length = x.shape[:2]
        start, prompt = self.gen_start, layer == 0 or self.refresh_prompt
        column = torch.arange(length, device=x.device)
        self.verified = None
        if layer == 0 or self.refresh_answer:
            through = column[0 if prompt else start:].expand(batch, -1)
        else:
            through = column[:start if prompt else 0].expand(batch, -1)
            if self.policy.transfer_ratio > 0:
                through = torch.cat((through, start + self.verify(layer, x[:, start:])), 1)
        self.counted[layer] = batch * through.shape[1]
        return through

    def verify(self, layer: int, x: Tensor) -> Tensor:
        """V-verify of the answer rows' layer input `x` `[B, G, d]`: their values replace the stored ones; returns the
        `[B, int(G x ratio)]` answer offsets of the least similar, least first (`topk` order)."""
        values = self.model.layers[layer].values(x)
        stored = self.v[layer][:, :, self.gen_start:]
        similarity = cosine(values.transpose(1, 2).flatten(2), stored.transpose(1, 2).flatten(2), -1, self.model.tp)
        self.v[layer][:, :, self.gen_start:] = self.verified = values
        count = int(x.shape[1] * self.policy.transfer_ratio)
        return similarity.topk(count, dim=1, largest=False).indices

    def update(self, layer: int, rows: Rows, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of the computed rows, the answer rows' values from V-verify when it ran."""
        keys, values = super().update(layer, rows, q, k, v)
        if self.verified is not None:
            values[:, :, self.gen_start:] = self.verified
        return keys, values

    def layer_output(self, layer: int, through: Tensor, x: Tensor, attended: Tensor, fed: Tensor) -> Tensor:
        """The computed rows' branch outputs stored; every row's input plus its stored attention, then feed-forward
        output."""
        index = through[..., None].expand(-1, -1, x.shape[-1])
        self.attended[layer].scatter_(1, index, attended)
        self.fed[layer].scatter_(1, index, fed)
        return x + self.attended[layer] + self.fed[layer]

    def count(self, rows: int, canvas_rows: int) -> None:
        """The rows each layer computed in this forward (V-verify's value projection of every answer row aside)."""
        self.rows_per_layer = [n + c for n, c in zip(self.rows_per_layer, self.counted)]

    @property
    def nbytes(self) -> int:
        return super().nbytes + sum(t.numel() * t.element_size() for t in self.attended + self.fed)
