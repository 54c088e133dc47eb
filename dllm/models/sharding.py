"""A rank's shard of a tensor-parallel model (spec `parallel_and_engine.md` A4's layer plan), as plain tensors with
explicit collectives (`parallel.Ranks`; DTensor's dispatch cost and missing sharding rules are why, BENCHMARKS.md):

| layer | this rank holds | collective |
|---|---|---|
| q, k, v (fused or not) | its heads' rows: `n_heads / N` query heads; key/value heads split, or the one its query heads read when there are fewer than N | none |
| o_proj | the columns of its query heads | all-reduce of the output |
| gate, up (fused) | rows `intermediate / N` of each | none |
| down | the matching columns | all-reduce of the output |
| norms, q/k norms, RoPE, router | all of it (replicated) | none |
| routed experts | `n_experts / N` whole experts (expert parallel); a token's other experts add nothing here | one all-reduce after the experts, |
| shared experts | rows / columns as gate, up / down | summed into the experts' partial output before it |
| embedding | vocabulary rows `[start, stop)`: a masked lookup | all-reduce of the output |
| LM head | the same vocabulary rows (tied: the same tensor) | none: the sampler merges statistics (`sharded_logits`) |

A shard is the same modules (`Block`, `GemmaBlock`) built from a per-rank config (`local_config`: heads, widths over
N), with `RowParallelLinear` for o_proj and down, `VocabParallelEmbedding`, and `ExpertParallelMoE`. `pieces` names
which slice of each full tensor a rank holds, so a shard is filled from a checkpoint's slices (or a full tensor's)
without a full copy of the model.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .moe import GatedMLP, MoE
from .parallel import Ranks
from .transformer import ModelConfig

SKIP = "skip"  # `pieces`: nothing of this tensor is on this rank (another rank's expert)


@dataclass(eq=False)
class Shard:
    """One rank's part of a tensor-parallel model (`model.tp`): its ranks and its vocabulary rows `[start, stop)`
    of `vocab` (the head's logits are `[..., stop - start]` here)."""

    ranks: Ranks
    vocab: int
    start: int
    stop: int

    @classmethod
    def of(cls, ranks: Ranks, vocab: int) -> "Shard":
        per = -(-vocab // ranks.size)
        return cls(ranks, vocab, min(ranks.rank * per, vocab), min((ranks.rank + 1) * per, vocab))

    @property
    def rank(self) -> int:
        return self.ranks.rank

    @property
    def size(self) -> int:
        return self.ranks.size

    def all_reduce(self, t: Tensor, kind: str) -> Tensor:
        return self.ranks.all_reduce(t, kind)

    def all_gather(self, t: Tensor, kind: str) -> Tensor:
        return self.ranks.all_gather(t, kind)

    def heads(self, count: int) -> range:
        """This rank's heads of `count` query heads (split evenly)."""
        per = count // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def kv_heads(self, count: int) -> range:
        """This rank's key/value heads: its share when they split evenly, else the one its query heads read."""
        if count % self.size == 0:
            return self.heads(count)
        head = self.rank * count // self.size
        return range(head, head + 1)


def refusal(cfg: ModelConfig, size: int) -> str | None:
    """Why `cfg` cannot be split over `size` ranks (None: it can)."""
    kv = [cfg.n_kv_heads, *([cfg.full_kv_heads] if hasattr(cfg, "full_kv_heads") else [])]
    dense = any(not cfg.is_moe_layer(i) for i in range(cfg.n_layers)) or hasattr(cfg, "full_kv_heads")
    if cfg.n_heads % size:
        return f"its {cfg.n_heads} attention heads do not split evenly over {size} ranks"
    if any(count % size and size % count for count in kv):
        return (f"its {' and '.join(map(str, kv))} key/value heads neither split evenly over {size} ranks nor divide "
                f"{size}")
    if dense and cfg.intermediate_size % size:
        return f"its feed-forward width {cfg.intermediate_size} does not split evenly over {size} ranks"
    if cfg.moe is not None and cfg.moe.n_experts % size:
        return f"its {cfg.moe.n_experts} experts do not split evenly over {size} ranks (expert parallel)"
    if cfg.moe is not None and cfg.moe.shared_size % size:
        return f"its shared experts' width {cfg.moe.shared_size} does not split evenly over {size} ranks"
    if cfg.vocab_size < size:
        return f"its vocabulary of {cfg.vocab_size} is smaller than {size} ranks"
    return None


def local_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The config one rank's layers are built from: its heads and feed-forward width (the experts are
    `ExpertParallelMoE`'s)."""
    fields = dict(n_heads=cfg.n_heads // size, n_kv_heads=max(cfg.n_kv_heads // size, 1), head_size=cfg.head_dim,
                  intermediate_size=cfg.intermediate_size // size)
    if hasattr(cfg, "full_kv_heads"):  # DiffusionGemma's full-attention layers
        fields["full_kv_heads"] = max(cfg.full_kv_heads // size, 1)
    return dataclasses.replace(cfg, **fields)


class RowParallelLinear(nn.Linear):
    """A linear layer (no bias) holding this rank's input columns: its outputs are partial sums, all-reduced."""

    def __init__(self, in_features: int, out_features: int, shard: Shard):
        super().__init__(in_features, out_features, bias=False)
        self.shard = shard

    def forward(self, x: Tensor) -> Tensor:
        return self.shard.all_reduce(F.linear(x, self.weight), "layer")


class VocabParallelEmbedding(nn.Embedding):
    """The embedding rows `[start, stop)` of the vocabulary: each rank looks up the tokens it holds (zero for the
    others) and the ranks' lookups are summed."""

    def __init__(self, shard: Shard, dim: int):
        super().__init__(shard.stop - shard.start, dim)
        self.shard = shard

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.shard.start
        held = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight).masked_fill(~held[..., None], 0.0)
        return self.shard.all_reduce(out, "embedding")

    def expected(self, probs: Tensor) -> Tensor:
        """`probs @ embedding` over the whole vocabulary, `probs` `[..., vocab]` the same on every rank (vLLM's fix
        #46177 for DiffusionGemma's self-conditioning: each rank its slice, all-reduced)."""
        local = probs[..., self.shard.start:self.shard.stop] @ self.weight
        return self.shard.all_reduce(local, "embedding")


def expected_embedding(probs: Tensor, embed: nn.Embedding) -> Tensor:
    """`probs @ embed.weight`, the expected embedding under `probs` `[..., vocab]` (a sharded embedding's own)."""
    return embed.expected(probs) if isinstance(embed, VocabParallelEmbedding) else probs @ embed.weight


class ExpertParallelMoE(MoE):
    """A mixture of experts holding experts `[first, first + n_experts / N)` whole and its share of the shared
    experts' width; the router is replicated, so every rank routes alike, computes the token copies routed to its
    experts, adds its shared partial and all-reduces (no all-to-all: every rank holds every token)."""

    def __init__(self, d: int, cfg, shard: Shard):
        super().__init__(d, dataclasses.replace(cfg, shared_size=0))
        self.cfg, self.shard = cfg, shard
        local = cfg.n_experts // shard.size
        self.first, self.local = shard.rank * local, local
        self.experts_gate_up = nn.Parameter(torch.empty(local, 2 * cfg.expert_size, d))
        self.experts_down = nn.Parameter(torch.empty(local, d, cfg.expert_size))
        if cfg.shared_size:
            self.shared = GatedMLP(d, cfg.shared_size // shard.size)

    def routed(self, x: Tensor, chosen: Tensor, weights: Tensor) -> Tensor:
        here = chosen - self.first
        held = (here >= 0) & (here < self.local)
        experts, order = here.masked_fill(~held, self.local).flatten().sort(stable=True)  # others' copies last
        count = int(held.sum())  # one wait for the device: how many copies this rank computes
        if not count:
            return torch.zeros_like(x)
        return self.grouped(x, experts[:count], order[:count], weights, self.local)

    def forward(self, x: Tensor, router_input: Tensor | None = None) -> Tensor:
        return self.shard.all_reduce(super().forward(x, router_input), "experts")


def shard_model(model: nn.Module, shard: Shard) -> nn.Module:
    """Turn a full model on the meta device into `shard`'s part of it, in place (shapes only: fill it after)."""
    cfg, d = model.config, model.config.hidden_size
    local = local_config(cfg, shard.size)
    block = type(model.layers[0])
    model.layers = nn.ModuleList(_shard_block(block(local, i), cfg, shard) for i in range(cfg.n_layers))
    model.embed = VocabParallelEmbedding(shard, d)
    model.lm_head = nn.Linear(d, shard.stop - shard.start, bias=False)
    model.tp = shard
    model.init_buffers()  # a tied head is the embedding's rows
    return model


def _shard_block(layer: nn.Module, cfg: ModelConfig, shard: Shard) -> nn.Module:
    layer.o_proj = RowParallelLinear(layer.o_proj.in_features, layer.o_proj.out_features, shard)
    mlp = layer.mlp if hasattr(layer, "mlp") else layer  # DiffusionGemma's dense GeGLU, or the block's SwiGLU
    if hasattr(mlp, "down_proj"):
        mlp.down_proj = RowParallelLinear(mlp.down_proj.in_features, mlp.down_proj.out_features, shard)
    if hasattr(layer, "moe"):
        layer.moe = ExpertParallelMoE(cfg.hidden_size, cfg.moe, shard)
    return layer


_LAYER = re.compile(r"layers\.(\d+)\.")


def pieces(cfg: ModelConfig, shard: Shard, target: str):
    """Which part of a full tensor rank `shard.rank` holds, for a name-table target `name[@expert][:part]` (see
    `checkpoint.py`; a parameter's own name for the whole tensor): None (all of it), `SKIP` (none: another rank's
    expert) or `(dim, [(start, stop), ...])`, the ranges along `dim` that, concatenated, are its piece."""
    name, _, part = target.partition(":")
    name, _, expert = name.partition("@")
    words = name.split(".")
    module = words[-2] if words[-1] in ("weight", "bias") else words[-1]
    if name in ("embed.weight", "lm_head.weight"):
        return 0, [(shard.start, shard.stop)]
    if name.startswith("self_conditioning."):  # DiffusionGemma's self-conditioning GeGLU: replicated
        return None
    layer = int(_LAYER.match(name).group(1)) if _LAYER.match(name) else None
    if module.startswith("experts_"):
        first = shard.rank * (cfg.moe.n_experts // shard.size)
        own = range(first, first + cfg.moe.n_experts // shard.size)
        if expert:
            return None if int(expert) in own else SKIP
        return 0, [(own.start, own.stop)]
    if layer is None:
        return None
    heads, size = (cfg.kv_shape(layer) if hasattr(cfg, "kv_shape") else (cfg.n_kv_heads, cfg.head_dim))
    q_rows = _rows(shard.heads(cfg.n_heads), size)
    kv_rows = _rows(shard.kv_heads(heads), size)
    if module == "qkv_proj":
        q, kv = cfg.n_heads * size, heads * size
        parts = {"q": [q_rows], "k": [kv_rows], "v": [kv_rows],
                 "": [q_rows, _moved(kv_rows, q), _moved(kv_rows, q + kv)]}
        return 0, parts[part]
    if module == "q_proj":
        return 0, [q_rows]
    if module in ("k_proj", "v_proj"):
        return 0, [kv_rows]
    if module == "o_proj":
        return 1, [q_rows]
    width = cfg.moe.shared_size if ".shared." in name else cfg.intermediate_size
    f_rows = (shard.rank * width // shard.size, (shard.rank + 1) * width // shard.size)
    if module == "gate_up_proj":
        return 0, [f_rows] if part else [f_rows, _moved(f_rows, width)]
    if module == "down_proj":
        return 1, [f_rows]
    return None


def local_target(cfg: ModelConfig, shard: Shard, target: str) -> str:
    """`target`'s name in the shard: an expert numbered among this rank's."""
    name, sep, part = target.partition(":")
    name, at, expert = name.partition("@")
    if at:
        name = f"{name}@{int(expert) - shard.rank * (cfg.moe.n_experts // shard.size)}"
    return name + sep + part


def take(t: Tensor, piece) -> Tensor:
    """`t`'s piece (`pieces`) as one tensor."""
    if piece is None:
        return t
    dim, ranges = piece
    return torch.cat([t.narrow(dim, a, b - a) for a, b in ranges], dim) if len(ranges) > 1 else \
        t.narrow(dim, ranges[0][0], ranges[0][1] - ranges[0][0])


def _rows(heads: range, size: int) -> tuple[int, int]:
    return heads.start * size, heads.stop * size


def _moved(rows: tuple[int, int], offset: int) -> tuple[int, int]:
    return rows[0] + offset, rows[1] + offset


def ranks_sum(t: Tensor, shard: Shard | None) -> Tensor:
    """`t` summed over the ranks of a tensor-parallel model (a cache's statistic of this rank's heads), else `t`."""
    return t if shard is None else shard.all_reduce(t, "cache")


def head_mean(t: Tensor, shard: Shard | None) -> Tensor:
    """The mean of `t` `[B, H, ...]` over all query heads (split over the ranks of a tensor-parallel model)."""
    return t.mean(1) if shard is None else shard.all_reduce(t.sum(1), "cache") / (t.shape[1] * shard.size)


def cosine(x: Tensor, y: Tensor, dim: int, shard: Shard | None) -> Tensor:
    """`F.cosine_similarity(x, y, dim)`, of vectors whose dimension `dim` a tensor-parallel model splits over its
    ranks (heads): their pieces' products summed over the ranks (a key/value head several ranks hold counts on each,
    in every sum alike)."""
    if shard is None:
        return F.cosine_similarity(x, y, dim=dim)
    dot, xx, yy = shard.all_reduce(torch.stack(((x * y).sum(dim), (x * x).sum(dim), (y * y).sum(dim))), "cache")
    return dot / (xx * yy).clamp_min(1e-16).sqrt()
