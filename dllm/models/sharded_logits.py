"""Logits of a tensor-parallel model's vocabulary-sharded head: each rank holds columns `[start, stop)` of `[..., V]`
(spec `parallel_and_engine.md` A4, "Sampler statistics on a sharded head").

`ShardedLogits` answers what samplers ask of logits with a few numbers per row merged over the ranks in one
all-gather, never a gather of the full vocabulary: the argmax (ties to the smallest id, as `torch.argmax`, also of
logits plus Gumbel noise drawn over the whole vocabulary from each row's generator, so every rank and a single
process draw the same), a token's probability, the entropy, the top-k values. The merges run on the same gathered
numbers on every rank, so every rank takes the same decision. A token's log-probability and the top-k of the
log-softmax (what `logprobs=k` captures) merge alike. `full()` gathers the whole vocabulary for what needs
it (counted as `gather` traffic): a sampler that reads the logits any other way gets them gathered by the loop
(`Sampler.reads_shards`).

Per row and rank r over its columns: the max m_r with its id (merged: M = max m_r, the id the smallest reaching M),
the token's logit where r owns it, then S_r = sum exp(l - M) (merged: S = sum_r S_r); p(token) = exp(l_token - M) *
(1 / S), as torch's fp32 softmax computes it, so that probabilities round alike (a saturated 1.0 stays 1.0: samplers
rank positions by them); the entropy from the log-softmax l - M - log S, each rank's terms summed. Each merge is one
all-gather of a number or two per row.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .sharding import Shard


class TopK(NamedTuple):
    values: Tensor
    indices: Tensor


class ShardedLogits:
    """This rank's columns `local` `[..., stop - start]` of logits `[..., vocab]`; `shape` is the whole one's. Indexing
    and arithmetic act on the leading dimensions (and on a whole-vocabulary operand's own columns); reductions over
    the vocabulary merge the ranks."""

    def __init__(self, local: Tensor, shard: Shard):
        self.local, self.shard = local, shard
        self._top: Tensor | None = None  # the merged row max (fp32), once a merge has read it: the next reuses it

    # -- what samplers read as of a tensor ----------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.local.shape[:-1], self.shard.vocab))

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    def dim(self) -> int:
        return self.local.dim()

    def _like(self, local: Tensor) -> "ShardedLogits":
        return ShardedLogits(local, self.shard)

    def __getitem__(self, index) -> "ShardedLogits":
        index = index if isinstance(index, tuple) else (index,)
        if Ellipsis in index or sum(1 for i in index if i is not None) >= self.dim():
            raise IndexError("index the leading dimensions of sharded logits only (the vocabulary is split over the "
                             "ranks)")
        return self._like(self.local[index])

    def float(self) -> "ShardedLogits":
        return self._like(self.local.float())

    def double(self) -> "ShardedLogits":
        return self._like(self.local.double())

    def expand(self, *sizes: int) -> "ShardedLogits":
        return self._like(self.local.expand(*sizes[:-1], -1))

    def _columns(self, other):
        """An operand as this rank's columns: a whole-vocabulary tensor's own, anything else as it is."""
        if isinstance(other, Tensor) and other.dim() and other.shape[-1] == self.shard.vocab > 1:
            return other[..., self.shard.start:self.shard.stop]
        return other

    def __add__(self, other) -> "ShardedLogits":
        return self._like(self.local + self._columns(other))

    def __truediv__(self, other) -> "ShardedLogits":
        return self._like(self.local / self._columns(other))

    def argmax(self, dim: int = -1) -> Tensor:
        return self.max(dim).indices

    # -- merged over the ranks ----------------------------------------------------------------------------------
    def _gather(self, *stats: Tensor) -> Tensor:
        """`[size, ..., k]` of this rank's `k` statistics per row (float64), every rank's."""
        return self.shard.all_gather(torch.stack([s.double() for s in stats], -1), "sampler")

    def max(self, dim: int = -1) -> TopK:
        """The largest logit of each row and its id (the smallest id among equal ones, as `torch.argmax`)."""
        _check_last(dim, self.dim())
        values, ids = self.local.max(-1)
        ranks = self._gather(values, ids + self.shard.start)
        best = ranks[..., 0].nan_to_num(nan=-torch.inf).amax(0)
        ids = ranks[..., 1].masked_fill(ranks[..., 0] != best, torch.inf).amin(0)
        self._top = best.float()
        return TopK(best.to(self.dtype), ids.long())

    def topk(self, k: int, dim: int = -1) -> TopK:
        """The `k` largest logits of each row and their ids (`k` small: each rank sends its own k)."""
        _check_last(dim, self.dim())
        local = self.local.topk(min(k, self.local.shape[-1]), -1)
        pad = k - local.values.shape[-1]
        values = torch.cat((local.values.double(), local.values.new_full((*local.values.shape[:-1], pad), -torch.inf)
                            .double()), -1)
        ids = torch.cat((local.indices + self.shard.start, local.indices.new_zeros((*local.indices.shape[:-1], pad))),
                        -1)
        ranks = self.shard.all_gather(torch.cat((values, ids.double()), -1), "sampler")  # [size, ..., 2k]
        values = torch.cat(ranks[..., :k].unbind(0), -1)
        ids = torch.cat(ranks[..., k:].unbind(0), -1)
        order = ids.argsort(dim=-1, stable=True)  # equal values: the smaller id first
        values, ids = values.gather(-1, order), ids.gather(-1, order)
        top = values.topk(k, -1, sorted=True)
        return TopK(top.values.to(self.dtype), ids.gather(-1, top.indices).long())

    def _row_max(self, logits: Tensor, own: bool = True) -> Tensor:
        """The merged row max M of fp32 `logits`: this object's `local` (`own`: merged once, then reused) or a masked
        copy of them."""
        if own and self._top is not None:
            return self._top
        top = self._gather(logits.amax(-1))[..., 0].amax(0).float()
        if own:
            self._top = top
        return top

    def _normalizer(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """The row max M and sum S of exp(logit - M) of fp32 `logits` (this rank's columns), merged: the two numbers
        torch's fp32 softmax divides by (exp(l - M) * (1 / S)), so that a merged probability rounds as the whole
        row's softmax does wherever it can (the most probable token's is 1 / S in both)."""
        top = self._row_max(logits)
        sums = self._gather((logits - top[..., None]).exp().sum(-1))[..., 0].float()
        return top, sums.sum(0)

    def token_probability(self, tokens: Tensor, unscored: Tensor | None = None) -> Tensor:
        """`softmax(logits.float())[token]` of each row (`samplers.token_probability`, whose `unscored` ids or
        `[B, V]` mask score as if their logits were -inf): the token's logit and S in one all-gather after M (none
        for M after `argmax`)."""
        logits = self.local.float()
        if unscored is not None:
            logits = logits.masked_fill(self._unscored(unscored, logits), -torch.inf)
        top = self._row_max(logits, own=unscored is None)
        merged = self._gather(self._owned(logits, tokens[..., None])[..., 0], (logits - top[..., None]).exp().sum(-1))
        chosen, total = merged[..., 0].amax(0).float(), merged[..., 1].float().sum(0)
        return (chosen - top).exp() * (1 / total)

    def _owned(self, logits: Tensor, index: Tensor) -> Tensor:
        """`logits`' values at the ids `index` this rank holds, -inf at the others'."""
        local = index - self.shard.start
        held = (local >= 0) & (local < logits.shape[-1])
        return logits.gather(-1, local.clamp(0, logits.shape[-1] - 1)).masked_fill(~held, -torch.inf)

    def gather(self, dim: int, index: Tensor) -> Tensor:
        """`logits.gather(-1, index)` of the whole logits: each id's value, from the rank that holds it."""
        _check_last(dim, self.dim())
        return self.shard.all_gather(self._owned(self.local, index), "sampler").amax(0)

    def log_softmax(self, dim: int = -1) -> "ShardedLogits":
        """`logits.float().log_softmax(-1)`, this rank's columns of it: l - M - log S, M and S merged."""
        _check_last(dim, self.dim())
        logits = self.local.float()
        top, total = self._normalizer(logits)
        return self._like(logits - top[..., None] - total.log()[..., None])

    def _unscored(self, unscored: Tensor, logits: Tensor) -> Tensor:
        """`[..., stop - start]` bool: this rank's columns that `unscored` leaves out."""
        if unscored.dim() == 2:  # a mask per row
            mask = unscored[:, self.shard.start:self.shard.stop]
            return mask.view(len(mask), *[1] * (logits.dim() - 2), -1)
        mask = torch.zeros(self.shard.stop - self.shard.start, dtype=torch.bool, device=logits.device)
        local = unscored - self.shard.start
        mask[local[(local >= 0) & (local < len(mask))]] = True
        return mask

    def max_probability(self) -> Tensor:
        """The largest probability of each row (fp32)."""
        return self.token_probability(self.argmax())

    def entropy(self) -> Tensor:
        """Entropy (nats) of softmax(logits) of each row in fp32, as `samplers.token_entropy` computes it from the
        log-softmax x - M - log S (a -inf logit counts 0): each rank its columns' terms, summed over the ranks."""
        logp = self.log_softmax().local
        terms = -(logp.exp() * logp.clamp(min=torch.finfo(logp.dtype).min)).sum(-1)
        return self._gather(terms)[..., 0].float().sum(0)

    def full(self) -> Tensor:
        """The whole `[..., vocab]` logits on every rank (an all-gather of every rank's columns, `gather` traffic)."""
        width = -(-self.shard.vocab // self.shard.size)
        local = self.local
        if local.shape[-1] < width:  # the last rank's columns, padded to the others' width
            local = torch.cat((local, local.new_zeros((*local.shape[:-1], width - local.shape[-1]))), -1)
        ranks = self.shard.all_gather(local, "gather")
        return torch.cat(ranks.unbind(0), -1)[..., :self.shard.vocab]


def _check_last(dim: int, dims: int) -> None:
    if dim not in (-1, dims - 1):
        raise IndexError("sharded logits reduce over the vocabulary (dim -1) only")


def full_logits(logits):
    """`logits` as one tensor over the whole vocabulary (gathered where sharded)."""
    return logits.full() if isinstance(logits, ShardedLogits) else logits


def vocabulary_view(logits: Tensor, model) -> Tensor | ShardedLogits:
    """A head's logits as the samplers read them: this rank's columns as `ShardedLogits` on a tensor-parallel
    model, else as they are."""
    return logits if model.tp is None else ShardedLogits(logits, model.tp)


def set_column(logits: Tensor, token: int, value: float, shard: Shard | None) -> None:
    """`logits[..., token] = value` in place, on a tensor-parallel rank `shard` where it holds that column."""
    column = token if shard is None else token - shard.start
    if 0 <= column < logits.shape[-1]:
        logits[..., column] = value
