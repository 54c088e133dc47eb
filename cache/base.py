from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor

from dllm.core.params import Params, Registry
from dllm.models.transformer import Rows


def gather_rows(t: Tensor, rows: Rows) -> Tensor:
    """`t[:, rows]` of a `[B, L, ...]` tensor."""
    if rows.is_slice:
        return t[:, rows.index]
    if rows.index.dim() == 1:
        return t.index_select(1, rows.index)
    index = rows.index.reshape(*rows.index.shape, *[1] * (t.dim() - 2)).expand(*rows.index.shape, *t.shape[2:])
    return t.gather(1, index)


def write_rows(store: Tensor, dim: int, rows: Rows, fresh: Tensor) -> None:
    """Write `fresh` into `store` at the canvas `rows` of its dimension `dim` (2 for `[B, H, L, D]`, 1 for
    `[B, L, d]`). Padding slots (`rows.valid` False) keep what the store holds."""
    if rows.is_slice:
        store[(slice(None),) * dim + (rows.index,)] = fresh
        return
    if rows.index.dim() == 1:
        store.index_copy_(dim, rows.index, fresh)
        return
    shape = [rows.index.shape[0]] + [1] * (store.dim() - 1)
    shape[dim] = rows.index.shape[1]
    index = rows.index.reshape(shape).expand_as(fresh)
    if rows.valid is not None:
        fresh = torch.where(rows.valid.reshape(shape), fresh, store.gather(dim, index))
    store.scatter_(dim, index, fresh)


def index_rows(active: Tensor) -> Rows:
    """The rows of a `[B, L]` bool mask as a `[B, A]` index (ascending, A = the most any batch row has) with
    the `[B, A]` mask of its real slots. Shorter rows are padded with distinct inactive rows: computed, counted,
    never written (see `write_rows`), so every batch row gets exactly its own rows' values."""
    count = active.sum(1)
    order = (~active).to(torch.uint8).argsort(dim=1, stable=True)  # active rows first, each group ascending
    width = int(count.max())
    return Rows(order[:, :width], torch.arange(width, device=active.device) < count[:, None])


def row_slots(rows: Rows, lo: int, hi: int, length: int, device: torch.device) -> Tensor:
    """Where canvas rows `[lo, hi)` sit among the computed `rows` (a slice or a `[B, A]` index): `[B or 1, hi - lo]`,
    -1 for a row not computed. Row -1 (a shifted model's block at column 0, which starts in the prompt) is read as
    row 0, as a slice's slots are clamped (`Runner._slots`)."""
    if rows.is_slice:
        return torch.arange(lo - rows.index.start, hi - rows.index.start, device=device)[None]
    index, width = rows.index, rows.index.shape[1]
    slot = torch.arange(width, device=index.device).expand_as(index)
    if rows.valid is not None:
        slot = slot.masked_fill(~rows.valid, -1)
    slots = torch.full((index.shape[0], length), -1, device=index.device).scatter(1, index, slot)
    return slots[:, lo:hi] if lo >= 0 else slots[:, torch.arange(lo, hi, device=index.device).clamp(min=0)]


def predicting_rows(positions: Tensor, shift: int) -> Tensor:
    """The `[B, L]` rows whose hidden states score the `[B, L]` bool `positions` (row i - shift scores i)."""
    if not shift:
        return positions
    rows = positions.roll(-shift, 1)
    rows[:, -shift:] = False
    return rows


def zeros(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> list[Tensor]:
    """Zeroed tensors of `shapes`, one each: a store's memory, made per generation (`StoreLender.take` keeps it at
    lasting addresses instead)."""
    return [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]


class PassThrough:
    """No storage: the active rows are the only keys. Its no-op `expand`, `attention_rows`, `observe_attention`,
    `layer_rows` and `observe_output` are the hooks a cache overrides (see `dllm.models.KVAccess`).
    `rows_per_layer` counts the rows computed per layer (batch summed), told by the loop through `count`."""

    def __init__(self, n_layers: int):
        self.rows_per_layer = [0] * n_layers

    def count(self, rows: int, canvas_rows: int) -> None:
        """One forward computed `rows` rows at every layer (a cache that grows them to every one of the
        `canvas_rows` from some layer on says so)."""
        self.rows_per_layer = [n + rows for n in self.rows_per_layer]

    def expand(self, layer: int, rows: Rows, x: Tensor) -> tuple[Tensor, Tensor] | None:
        return None

    def update(self, layer: int, rows: Rows, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return k, v

    def attention_rows(self, layer: int, rows: Rows) -> Tensor | None:
        return None

    def observe_attention(self, layer: int, rows: Rows, probs: Tensor) -> None:
        pass

    def layer_rows(self, layer: int, rows: Rows, x: Tensor) -> Tensor | None:
        return None

    def observe_output(self, rows: Rows, x: Tensor) -> None:
        pass

    @property
    def nbytes(self) -> int:
        return 0

    def fork(self, copies: int, allocate: Callable[..., list[Tensor]] = zeros) -> "PassThrough":
        """A view for `copies` draft canvases per row (batch `B * copies`), its memory from `allocate`."""
        return copy.copy(self)

    def adopt(self, fork: "PassThrough", choice: Tensor, rows: slice) -> None:
        """Take the state of draft `choice[b]` of each row, computed at canvas `rows`, from `fork`."""

    def take_rows(self, index: Tensor) -> "PassThrough":
        """A store for the batch rows `index` alone (a forward that leaves the other rows out), its memory copied
        out; `put_rows` copies it back."""
        return copy.copy(self)

    def put_rows(self, part: "PassThrough", index: Tensor) -> None:
        """Take back `part` (from `take_rows(index)`) after its forward, with the rows it counted."""
        self.rows_per_layer = part.rows_per_layer


class KVStore(PassThrough):
    """Post-RoPE K/V of the whole canvas: `k[layer]`, `v[layer]` `[B, Hkv, L, D]`, each layer's `(Hkv, D)` from
    `shapes` (the model's `kv_shapes()`: DiffusionGemma's full layers differ from its sliding ones), zeroed tensors
    from `allocate` (`zeros`, or a lender's), written in place at the active rows. A row that is not active keeps
    the value written the last time it was computed.

    One tensor per layer and kind rather than views of one buffer: a compiled forward that writes into views of one
    buffer copies the whole buffer at every layer (inductor turns a view's in-place write into a copy of its base),
    which made llada-small's compiled cached forward 2.2x (batch 1) to 3.6x (batch 8) slower on a CPU at gen 256
    (BENCHMARKS.md)."""

    def __init__(self, shapes: list[tuple[int, int]], batch: int, length: int, dtype: torch.dtype,
                 device: torch.device, allocate: Callable[..., list[Tensor]] = zeros):
        super().__init__(len(shapes))
        tensors = allocate([(batch, heads, length, size) for heads, size in shapes] * 2, dtype, device)
        self.k, self.v = tensors[:len(shapes)], tensors[len(shapes):]

    def update(self, layer: int, rows: Rows, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        write_rows(self.k[layer], 2, rows, k)
        write_rows(self.v[layer], 2, rows, v)
        return self.k[layer], self.v[layer]

    @property
    def tensors(self) -> list[Tensor]:
        """Every tensor of the store, in `allocate`'s order."""
        return self.k + self.v

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def fork(self, copies: int, allocate: Callable[..., list[Tensor]] = zeros) -> "KVStore":
        """The store repeated per draft (FreeDave's batch expansion; draft copies of a row side by side) in
        tensors from `allocate`: drafts write their own rows only."""
        view = copy.copy(self)
        tensors = allocate([(t.shape[0] * copies, *t.shape[1:]) for t in self.tensors], self.k[0].dtype,
                           self.k[0].device)
        for fork, mine in zip(tensors, self.tensors):
            fork.unflatten(0, (mine.shape[0], copies)).copy_(mine[:, None])
        view.k, view.v = tensors[:len(self.k)], tensors[len(self.k):]
        return view

    def take_rows(self, index: Tensor) -> "KVStore":
        part = copy.copy(self)
        part.k, part.v = [t.index_select(0, index) for t in self.k], [t.index_select(0, index) for t in self.v]
        return part

    def put_rows(self, part: "KVStore", index: Tensor) -> None:
        super().put_rows(part, index)
        for mine, theirs in zip(self.tensors, part.tensors):
            mine.index_copy_(0, index, theirs)

    def adopt(self, fork: "KVStore", choice: Tensor, rows: slice) -> None:
        """Draft `choice[b]`'s `rows` (a slice: drafts verify between refreshes) into this store."""
        pick = torch.arange(len(choice), device=choice.device) * (fork.k[0].shape[0] // len(choice)) + choice
        for mine, drafts in zip(self.tensors, fork.tensors):
            mine[:, :, rows] = drafts[pick][:, :, rows]


@dataclass
class PlanContext:
    """What a cache sees before a forward; the loop says what changed, so no cache diffs the canvas."""

    canvas: Any  # the generation's `Canvas`: tokens [B, L], positions [B, L], key_mask (read only)
    masked: Tensor  # [B, L] bool: masked now
    masked_before: Tensor | None  # [B, L] bool: masked when the previous forward was planned (None before the first)
    next_commits: Tensor | None  # [B, L] bool: what the next step commits (caches with `needs_next_commits`)
    step: int  # step inside the block, from 0
    start: int  # block [start, end)
    end: int
    lo: int  # canvas positions [lo, hi) need logits
    hi: int
    shift: int  # 1 for AR-shifted models (Dream): position i is scored by row i - 1
    family: str  # "llada" | "dream": whose papers' defaults apply (aligned logits: LLaDA's; shifted: Dream's)

    @property
    def decoded(self) -> Tensor | None:
        """[B, L] bool: decoded since the previous forward was planned (None before the first); computed only for
        the caches that ask."""
        return None if self.masked_before is None else self.masked_before & ~self.masked


@dataclass
class Cache(Params):
    """A cache policy: `plan` picks the canvas rows computed at each forward; all other rows are read from
    the store. Block policies implement `active_rows`; subclasses set `stores_kv = False` when nothing needs
    storing."""

    stores_kv: ClassVar[bool] = True
    verifies_drafts: ClassVar[bool] = False  # True when the store is its only per-step state (`fork`/`adopt`)
    needs_next_commits: ClassVar[bool] = False  # `plan` needs the next step's commits before its forward
    compiles: ClassVar[bool] = False  # its rows are always slices, so the forward can run compiled
    covers_window: ClassVar[bool] = False  # every forward computes the rows that predict the sampler's whole window
    # (none of its positions left without a prediction), so a sampler may read decoded positions' logits
    block_causal_only: ClassVar[bool] = False  # exact only when blocks never attend to later ones (SDAR, Nemotron)
    rows_coupled: ClassVar[bool] = False  # a row's refresh depends on its batch neighbours (so padded != alone)
    reads_model_outputs: ClassVar[bool] = False  # plans from the model's attention and predictions (d2Cache)
    block_fresh: ClassVar[bool] = False  # recomputes every row at each block start: nothing in the store outlives
    # a block, so a batch can be laid out anew between blocks (rows joining and leaving, `dllm serve`)
    follows_window: ClassVar[bool] = False  # exact on WeDLM's sliding window, whose columns move every step
    # (`engine.layouts.SlidingWindow`): it recomputes every column a step may have filled since its last forward
    keeps_final_blocks: ClassVar[bool] = False  # its store's `final`: the columns before it hold final keys and
    # values of whole blocks, and a fresh store computes from there (`block`), so `PrefixBlocks` can fill and keep them

    def new_kv(self, model, batch: int, length: int, allocate: Callable[..., list[Tensor]] = zeros) -> PassThrough:
        """A fresh store for `batch` canvases of `length`, its memory from `allocate` (see `KVStore`)."""
        if not self.stores_kv:
            return PassThrough(model.config.n_layers)
        return KVStore(model.kv_shapes(), batch, length, model.dtype, model.device, allocate)

    def plan(self, kv: PassThrough, plan: PlanContext) -> Rows:
        """Rows to compute at the forward described by `plan`: a slice, or a `[B, A]` index with its valid
        slots. Called once before each forward. A position whose scoring row is not computed gets
        no prediction, so every position the sampler may commit (`[lo, hi)`) must be covered. Default: the
        block policy's `active_rows`, widened to the whole window."""
        rows = self.active_rows(plan.step, plan.start, plan.end, plan.masked.shape[1], plan.shift)
        first = max(min(rows.start, plan.lo - plan.shift), 0)  # a block at column 0 of a shifted block-causal model
        return Rows(slice(first, max(rows.stop, plan.hi - plan.shift)))

    def active_rows(self, step: int, start: int, end: int, length: int, shift: int) -> slice:
        """Rows to compute at `step` (0 = first step) of the block `[start, end)` of a canvas of `length`;
        `shift` = 1 for AR-shifted models, whose position i is scored by the hidden state of row i-1."""
        raise NotImplementedError


CACHES = Registry("cache", Cache)  # the caches by name
register = CACHES.register
