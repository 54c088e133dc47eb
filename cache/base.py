from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from dllm.params import Params


class PassThrough:
    """No storage: the active rows are the only keys. Counts rows computed per layer. Its no-op `expand`,
    `attention_rows` and `observe_attention` are the hooks a cache overrides (see `dllm.models.KVAccess`)."""

    def __init__(self, n_layers: int):
        self.rows_per_layer = [0] * n_layers
        self.rows: slice = slice(None)

    def expand(self, layer: int, x: Tensor) -> tuple[Tensor, Tensor] | None:
        return None

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.rows_per_layer[layer] += k.shape[0] * k.shape[2]
        return k, v

    def attention_rows(self, layer: int) -> Tensor | None:
        return None

    def observe_attention(self, layer: int, probs: Tensor) -> None:
        pass

    @property
    def nbytes(self) -> int:
        return 0

    def fork(self, copies: int) -> "PassThrough":
        """A view for `copies` draft canvases per row (batch `B * copies`) that counts into this one."""
        return copy.copy(self)

    def adopt(self, fork: "PassThrough", choice: Tensor) -> None:
        """Take the state of draft `choice[b]` of each row from `fork`."""


class KVStore(PassThrough):
    """Per-layer post-RoPE K/V of the whole canvas, `[B, Hkv, L, D]`, written in place at the active rows.

    A row that is not active keeps the value written the last time it was computed."""

    def __init__(self, n_layers: int, batch: int, kv_heads: int, length: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__(n_layers)
        shape = (batch, kv_heads, length, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        super().update(layer, k, v)
        self.k[layer][:, :, self.rows] = k
        self.v[layer][:, :, self.rows] = v
        return self.k[layer], self.v[layer]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def fork(self, copies: int) -> "KVStore":
        """The store repeated per draft (FreeDave's batch expansion): drafts write their own rows only."""
        view = copy.copy(self)
        view.k = [t.repeat_interleave(copies, 0) for t in self.k]
        view.v = [t.repeat_interleave(copies, 0) for t in self.v]
        return view

    def adopt(self, fork: "KVStore", choice: Tensor) -> None:
        pick = torch.arange(len(choice), device=choice.device) * (fork.k[0].shape[0] // len(choice)) + choice
        for mine, theirs in ((self.k, fork.k), (self.v, fork.v)):
            for layer, t in enumerate(theirs):
                mine[layer][:, :, fork.rows] = t[pick][:, :, fork.rows]


@dataclass
class Cache(Params):
    """A cache policy. `active_rows` picks the canvas rows computed at a step of a block; all other rows
    are read from the store. Subclasses set `stores_kv = False` when nothing needs storing."""

    stores_kv: ClassVar[bool] = True
    verifies_drafts: ClassVar[bool] = False  # True when the store is its only per-step state (`fork`/`adopt`)

    def new_kv(self, model, batch: int, length: int) -> PassThrough:
        cfg = model.config
        if not self.stores_kv:
            return PassThrough(cfg.n_layers)
        return KVStore(cfg.n_layers, batch, cfg.n_kv_heads, length, cfg.head_dim, model.dtype, model.device)

    def active_rows(self, step: int, start: int, end: int, length: int, shift: int) -> slice:
        """Rows to compute at `step` (0 = first step) of the block `[start, end)` of a canvas of `length`;
        `shift` = 1 for AR-shifted models, whose position i is scored by the hidden state of row i-1."""
        raise NotImplementedError
