"""The model over one canvas: counted forwards of the rows a cache chose, draft verification on a fork of the K/V
store, and the compiled forward (`torch.compile`, CUDA graphs on a GPU, stores lent at lasting addresses)."""
from __future__ import annotations

import copy
import threading
import time
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .. import cache as caches
from ..models import DiffusionLM, Rows
from ..models.sharded_logits import ShardedLogits, set_column
from ..samplers import ExtraRows
from .canvas import Canvas
from .guidance import Guidance, unconditional
from .stats import Stats

if TYPE_CHECKING:
    from ..cache import Cache


class Runner:
    """The model over one canvas and its cache store: counted forwards of chosen rows, and one-forward
    verification of drafts on a fork of the store (self-speculative decoding), adopted once one is chosen.

    `compiled`: forwards go through `compiled_run(model)`, their rows as position tensors so that a block step
    keeps one shape from block to block (caches whose rows are slices: none, prefix, dual, block); on a GPU as
    CUDA graphs (`graphed`), whose logits are copied out before the next replay overwrites them.

    `guidance` (`Guidance`): the logits it returns are guided; with classifier-free guidance every canvas row is
    computed beside its unconditional copy, which has its own rows in the store (`[row 0, its copy, row 1, ...]`),
    so every cache keeps each copy's keys and values exactly as the row's own."""

    def __init__(self, model: DiffusionLM, canvas: Canvas, cache: Cache, stats: Stats, profile: bool,
                 compiled: bool = False, guidance: Guidance = Guidance()):
        self.model, self.canvas, self.cache, self.guidance = model, canvas, cache, guidance
        self.stats, self.profile = stats, profile
        self.run = compiled_run(model) if compiled else model.run
        self.compiled, self.graphed = compiled, compiled and model.device.type == "cuda"
        self.allocate = store_lender(model).take if self.graphed else caches.zeros  # graphs: lasting addresses
        batch, length = canvas.tokens.shape
        self.kv = cache.new_kv(model, batch * (2 if guidance.guided else 1), length, self.allocate)
        self.prompt_columns = torch.arange(length, device=model.device) < canvas.gen_start[:, None]
        self.verified: tuple | None = None  # (drafts, fork, logits, rows) of the last `verify`
        self.slice_slots: dict[tuple, Tensor] = {}  # `_slots` of slice rows, by window

    def retire(self) -> None:
        """Give lent stores back (the runner is not used after this)."""
        self._give_back(self.kv)
        if self.verified is not None:
            self._give_back(self.verified[1])

    def _give_back(self, store: caches.PassThrough) -> None:
        if self.graphed and isinstance(store, caches.KVStore):
            store_lender(self.model).give_back(store.tensors)

    def forward(self, lo: int, hi: int, rows: Rows, tokens: Tensor | None = None, kv=None,
                inputs: dict | None = None, block: tuple[int, int] | None = None, extra: ExtraRows | None = None,
                kind: str | None = None) -> Tensor:
        """Logits of canvas positions `[lo, hi)` for every row of `tokens` (default: the canvas; or copies of
        it, drafts), computing `rows` against the store `kv` (default: the generation's); `inputs`: the sampler's
        further keywords of `model.run` (`Sampler.model_inputs`). On a causal-prefix model the positions being
        decoded run from the start of `block` (default `(lo, hi)`), the block being decoded, to `hi`: a row the
        sampler reads before the block is computed causally. `extra`: rows computed beside them (`ExtraRows`),
        whose logits (the wanted ones) follow the window's: `[B, hi - lo + E, V]`. `kind`: the profile's name of
        this forward (default: verify for draft copies, else full or cached)."""
        model, canvas, cfg = self.model, self.canvas, self.model.config
        tokens = canvas.tokens if tokens is None else tokens
        kv = self.kv if kv is None else kv
        batch, length = canvas.tokens.shape
        copies = tokens.shape[0] // batch
        if self.guidance.guided:  # each row beside its unconditional copy: [B, 2, K, L]
            tokens = tokens.unflatten(0, (batch, copies))
            tokens = torch.stack((tokens, unconditional(tokens, self.prompt_columns, cfg.mask_id)), 1).flatten(0, 2)
        every = tokens.shape[0] // batch  # rows computed per canvas row
        key_mask, positions = canvas.key_mask, canvas.positions
        if every > 1:
            positions = positions.repeat_interleave(every, 0)
            key_mask = None if key_mask is None else key_mask.repeat_interleave(every, 0)
            if not rows.is_slice and rows.index.dim() == 2:  # the cache chose rows per canvas row
                rows = Rows(rows.index.repeat_interleave(every, 0),
                            None if rows.valid is None else rows.valid.repeat_interleave(every, 0))
        slots = self._slots(rows, lo - cfg.logit_shift, hi - cfg.logit_shift, tokens.shape[0])
        if self.compiled and rows.is_slice:
            rows = Rows(torch.arange(length, device=model.device)[rows.index])
        if key_mask is not None and not self.cache.stores_kv:
            key_mask = key_mask[..., rows.index]
        query_positions = caches.gather_rows(positions, rows)
        first = lo if block is None else block[0]
        window = (positions[:, first], positions[:, hi - 1] + 1) if cfg.causal_prefix else None  # decoded now
        ranks = self._ranks(tokens, positions, every)
        query_ranks = caches.gather_rows(ranks, rows)
        key_ranks = ranks if self.cache.stores_kv else query_ranks
        run = (caches.gather_rows(tokens, rows), query_positions,
               model.visible_keys(query_ranks, key_ranks, key_mask, window), kv, rows,
               slots if rows.is_slice else slots.clamp(min=0))
        if extra is not None:
            run = self._with_extra(extra, every, run, ranks, key_ranks, key_mask, window)
        began = clock(model.device) if self.profile else 0.0
        if self.graphed:
            torch.compiler.cudagraph_mark_step_begin()  # the last replay's outputs are no longer read
        logits = self.run(*run, **(inputs or {}))
        if self.graphed:
            logits = logits.clone()
        if not rows.is_slice and rows.index.dim() == 2:  # rows served from the store predict nothing this step
            logits[slots < 0] = 0.0
        if self.guidance.guided:
            logits = self.guidance.combine(logits.unflatten(0, (batch, 2, copies))).flatten(0, 1)
        if cfg.mask_id is not None and canvas.uncommitted is None:  # a committed position must never stay masked
            # (where a flag says what is committed, WeDLM's window, the mask id is a token like any other)
            set_column(logits, cfg.mask_id, float("-inf"), model.tp)
        self.guidance.ban(logits, cfg, model.tp)
        computed = rows.index.shape[-1] if not rows.is_slice else len(range(length)[rows.index])
        counter = self.kv  # drafts' forwards on a fork count into the generation's store
        before = list(counter.rows_per_layer)
        counter.count(tokens.shape[0] * computed, tokens.shape[0] * length)
        full = all(now - then == tokens.shape[0] * length for now, then in zip(counter.rows_per_layer, before))
        if extra is not None:
            counter.count(tokens.shape[0] * extra.tokens.shape[1], 0)
        if self.profile:
            kind = kind or ("verify" if copies > 1 else "full" if full else "cached")
            self.stats.forward_seconds.setdefault(kind, []).append(clock(model.device) - began)
        self.stats.nfe += 1
        self.stats.full_forwards += int(full)
        return logits

    def _ranks(self, tokens: Tensor, positions: Tensor, every: int) -> Tensor:
        """What causal attention orders keys by (`visible_keys`): on a causal model (WeDLM, spec `wedlm.md` 1.4) the
        rank `(not yet committed, position)`, committed tokens before masks, each in position order, as the authors'
        reordered window; elsewhere the positions."""
        if not self.model.config.causal:
            return positions
        canvas = self.canvas
        pending = (tokens == canvas.mask_id if canvas.uncommitted is None
                   else canvas.uncommitted.repeat_interleave(every, 0))
        return positions + tokens.shape[1] * pending

    def _with_extra(self, extra: ExtraRows, every: int, run: tuple, ranks: Tensor, key_ranks: Tensor,
                    pad_mask: Tensor | None, window: tuple[Tensor, Tensor] | None) -> tuple:
        """`model.run`'s arguments with the extra rows after the canvas rows: their tokens and positions, the
        key mask over the canvas keys and theirs (no canvas row sees an extra row), their K/V kept out of the
        store (`ExtraKeys`) and their wanted logits after the window's. `ranks`: the canvas rows' (`_ranks`), of
        which an extra row takes its column's."""
        tokens, query_positions, key_mask, kv, rows, logit_rows = run
        model, (n, a) = self.model, tokens.shape
        e = extra.tokens.shape[1]
        extra_positions = self.canvas.positions[:, extra.columns].repeat_interleave(every, 0)
        extra_ranks = ranks[:, extra.columns]
        sees = extra.sees_canvas if self.cache.stores_kv else extra.sees_canvas[..., rows.index]
        sees_canvas = sees.repeat_interleave(every, 0)[:, None] if len(sees) > 1 else sees[:, None]
        own = model.visible_keys(extra_ranks, key_ranks, pad_mask, window)  # what a canvas row there sees
        sees_canvas = sees_canvas if own is None else sees_canvas & own
        padded = self.canvas.key_mask  # an extra row at a padding column is padding too
        padded = None if padded is None else padded[..., extra.columns].repeat_interleave(every, 0)
        own = model.visible_keys(extra_ranks, extra_ranks, padded, window)
        sees_extra = extra.sees_extra if own is None else extra.sees_extra & own
        canvas_sees = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=model.device) if key_mask is None else key_mask
        width = sees_canvas.shape[-1]  # the canvas keys
        mask = torch.cat((
            torch.cat((canvas_sees.expand(n, 1, a, width), sees_canvas.new_zeros((n, 1, a, e))), -1),
            torch.cat((sees_canvas.expand(n, 1, e, width), sees_extra.expand(n, 1, e, e)), -1)), 2)
        wanted = torch.arange(e, device=model.device) if extra.wanted is None else extra.wanted
        extra_tokens = extra.tokens.repeat_interleave(every, 0)
        if self.guidance.guided:  # in the unconditional copy an extra row at a prompt column is masked, as the canvas's
            extra_tokens[1::2] = unconditional(extra.tokens[:, None], self.prompt_columns[:, extra.columns],
                                               model.config.mask_id)[:, 0]
        if not rows.is_slice:  # compiled: every row's position, so that the graph sizes the canvas rows by all rows
            rows = Rows(torch.cat((rows.index, extra.columns)))
        return (torch.cat((tokens, extra_tokens), 1),
                torch.cat((query_positions, extra_positions), 1), mask, ExtraKeys(kv, e), rows,
                torch.cat((logit_rows, (a + wanted).expand(n, -1)), 1))

    def _slots(self, rows: Rows, lo: int, hi: int, batch: int) -> Tensor:
        """`[batch, hi - lo]`: where canvas rows `[lo, hi)` sit among the computed `rows` (-1: not computed). A
        slice's are the same at every step of a block, so they are made once per window (clamped at 0, as every
        slot the model reads: a shifted model's window may start one row before the slice)."""
        if not rows.is_slice:
            return caches.row_slots(rows, lo, hi, self.canvas.tokens.shape[1], self.model.device).expand(batch, -1)
        key = (lo - (rows.index.start or 0), hi - (rows.index.start or 0), batch)
        if key not in self.slice_slots:
            self.slice_slots[key] = caches.row_slots(rows, lo, hi, 0, self.model.device).clamp(min=0).expand(batch, -1)
        return self.slice_slots[key]

    def forward_open(self, lo: int, hi: int, rows: Rows, open_rows: list[bool], inputs: dict | None = None,
                     block: tuple[int, int] | None = None, extra: ExtraRows | None = None) -> Tensor:
        """`forward` of the batch rows `open_rows` alone, against a copy of their store rows (copied back after):
        the rows with nothing left to decode in a block are left out, their logits zero (MASK -inf) and their store
        rows as they were; only for caches that recompute every row at the next block start (`block_fresh`)."""
        index = torch.tensor([b for b, keep in enumerate(open_rows) if keep], device=self.model.device)
        part = copy.copy(self)
        part.canvas = self.canvas.take_rows(index)
        part.prompt_columns = self.prompt_columns.index_select(0, index)
        stored = torch.stack((2 * index, 2 * index + 1), 1).flatten() if self.guidance.guided else index  # + copies
        part.kv = self.kv.take_rows(stored)
        logits = part.forward(lo, hi, rows, inputs={k: v.index_select(0, index) for k, v in (inputs or {}).items()},
                              block=block, extra=None if extra is None else extra.take_rows(index))
        self.kv.put_rows(part.kv, stored)
        out = logits.new_zeros((len(open_rows), *logits.shape[1:]))
        if self.model.config.mask_id is not None:
            set_column(out, self.model.config.mask_id, float("-inf"), self.model.tp)
        return out.index_copy_(0, index, logits)

    def readable(self, logits: Tensor, shards: bool) -> Tensor | ShardedLogits:
        """Logits as a sampler reads them: on a tensor-parallel model this rank's vocabulary columns for a sampler
        that reads `shards` (`Sampler.reads_shards`), else the whole vocabulary gathered on every rank."""
        if self.model.tp is None:
            return logits
        sharded = ShardedLogits(logits, self.model.tp)
        return sharded if shards else sharded.full()

    def verify(self, drafts: Tensor, lo: int, hi: int, rows: Rows, block: tuple[int, int] | None = None,
               tree: bool = False) -> Tensor:
        """One forward over draft windows `[B, K, hi - lo]`: the logits `[B, K, hi - lo, V]` the next step would see
        on each draft, computing the next step's `rows` (a slice) per draft. By batch expansion (FreeDave's
        `batch_expanding`): K copies of each canvas row on a fork of the store, the generation's store unchanged.
        `tree` (FreeDave's tree attention, `get_tree_attention_mask_and_position_ids`): one row of the batch per
        canvas row, draft 0 computed as its rows and the others as extra rows beside them, each seeing the store's
        other columns and its own rows only; the store keeps draft 0's keys and values of `rows`, which every later
        forward computes again before reading them (drafts verify only where the next step computes this slice)."""
        batch, copies = drafts.shape[:2]
        if self.verified is not None:  # drafts the sampler did not take
            self._give_back(self.verified[1])
        if tree:
            tokens = self.canvas.tokens.clone()
            tokens[:, lo:hi] = drafts[:, 0]
            extra = self._branches(drafts[:, 1:], lo, hi, rows) if copies > 1 else None
            logits = self.forward(lo, hi, rows, tokens, block=block, extra=extra, kind="verify")
            self.verified = (drafts, None, logits.unflatten(1, (copies, hi - lo)), rows)
            return self.verified[2]
        tokens = self.canvas.tokens.repeat_interleave(copies, 0)
        tokens[:, lo:hi] = drafts.flatten(0, 1)
        fork = self.kv.fork(copies, self.allocate)  # graphs: the last fork's addresses again
        logits = self.forward(lo, hi, rows, tokens, fork, block=block).unflatten(0, (batch, copies))
        self.verified = (drafts, fork, logits, rows)
        return logits

    def _branches(self, drafts: Tensor, lo: int, hi: int, rows: Rows) -> ExtraRows:
        """Draft windows `[B, K, hi - lo]` as extra rows: per draft a copy of the canvas rows `rows` (a slice) holding
        it, seeing the canvas's other columns and its own rows; the logits wanted are its window's."""
        canvas, shift = self.canvas.tokens, self.model.config.logit_shift
        length, copies = canvas.shape[1], drafts.shape[1]
        first, end, _ = rows.index.indices(length)
        tokens = canvas[:, None].repeat(1, copies, 1)
        tokens[:, :, lo:hi] = drafts
        column, width = torch.arange(length, device=canvas.device), end - first
        branch = torch.arange(copies * width, device=canvas.device) // width
        slots = (torch.arange(lo - shift, hi - shift, device=canvas.device) - first).clamp(min=0)  # as `_slots`
        return ExtraRows(tokens=tokens[:, :, first:end].flatten(1), columns=column[first:end].repeat(copies),
                         sees_canvas=((column < first) | (column >= end)).expand(1, copies * width, -1),
                         sees_extra=branch[:, None] == branch[None],
                         wanted=(torch.arange(copies, device=canvas.device)[:, None] * width + slots).flatten())

    def adopt(self, choice: Tensor) -> tuple[Tensor, Tensor]:
        """Take draft `choice` `[B]` of the last `verify` into the store; returns the chosen drafts `[B, hi - lo]`
        (for the loop to check against the sampler's commits) and their logits, the next step's."""
        drafts, fork, logits, rows = self.verified
        pick = torch.arange(len(choice), device=choice.device)
        if fork is not None:  # (tree: nothing to take, see `verify`)
            self.kv.adopt(fork, choice.repeat_interleave(2) if self.guidance.guided else choice, rows.index)  # copies
            self._give_back(fork)
        self.verified = None
        return drafts[pick, choice], logits[pick, choice]


class ExtraKeys:
    """A store's K/V access (`dllm.models.KVAccess`) for a forward whose last `extra_rows` rows are extra rows
    (`ExtraRows`): the canvas rows' keys and values go to the store as ever; the extra rows' are appended to the
    keys every query may attend to, and never stored. Only for caches that compute slices (no rows grown, no
    attention observed: `checks.py`)."""

    def __init__(self, kv: caches.PassThrough, extra_rows: int):
        self.kv, self.extra_rows = kv, extra_rows

    def expand(self, layer: int, rows: Rows, x: Tensor) -> None:
        return None

    def update(self, layer: int, rows: Rows, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        e = self.extra_rows
        canvas = rows if rows.is_slice else Rows(rows.index[:-e])  # (compiled: positions of every row, see _with_extra)
        keys, values = self.kv.update(layer, canvas, q[:, :, :-e], k[:, :, :-e], v[:, :, :-e])
        return torch.cat((keys, k[:, :, -e:]), 2), torch.cat((values, v[:, :, -e:]), 2)

    def attention_rows(self, layer: int, rows: Rows) -> None:
        return None

    def observe_attention(self, layer: int, rows: Rows, probs: Tensor) -> None:
        pass

    def layer_rows(self, layer: int, rows: Rows, x: Tensor) -> None:
        return None

    def observe_output(self, rows: Rows, x: Tensor) -> None:
        pass


# A model's floats (RMSNorm eps) are compiled in as constants: a layer region (`Block`) takes tensors only, and
# without this a second model with another eps would pass it as a float. The patch is one object that sets torch's
# process-wide config, so one thread at a time holds it.
_CONSTANT_FLOATS = torch._dynamo.config.patch(specialize_float=True)
# torchao's quantized weights are tensor subclasses, which torch 2.13 cannot pass into a nested compile region ("no
# rule registered for HOP invoke_subgraph"): a quantized model's layers are traced inline, each one (slower to compile).
_CONSTANT_FLOATS_INLINE = torch._dynamo.config.patch(specialize_float=True, inline_invoke_subgraph=True)

_CONSTANT_FLOATS_LOCK = threading.Lock()


def compiled_run(model: DiffusionLM):
    """`model.run` under `torch.compile(fullgraph=True)`, made once per model. Shapes that change from call to
    call (prefix's rows shrinking block by block) are recompiled once as dynamic shapes. On a GPU the compiled
    forward is replayed as a CUDA graph (`mode="reduce-overhead"`: one launch per forward instead of hundreds),
    one graph per shape, its store lent by `StoreLender`."""
    run = getattr(model, "_compiled_run", None)
    if run is None:
        mode = "reduce-overhead" if model.device.type == "cuda" else None
        compiled = torch.compile(model.run, fullgraph=True, mode=mode)
        config = _CONSTANT_FLOATS_INLINE if model.quantization else _CONSTANT_FLOATS

        def run(*args, **kwargs):
            with _CONSTANT_FLOATS_LOCK, config:
                return compiled(*args, **kwargs)
        model._compiled_run = run
    return run


class StoreLender:
    """K/V store tensors at addresses that outlive a generation, lent one store at a time. A CUDA graph reads and
    writes the store where it was recorded: fresh tensors per generation would mean recording every graph again
    (and, past torch's re-record limit, no graphs at all). A store is lent whole, its tensors in one order (layer i
    gets the tensor it had). Keeps at most `keep` returned stores."""

    def __init__(self, keep: int = 4):
        self.free: list[list[Tensor]] = []
        self.keep = keep

    def take(self, shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> list[Tensor]:
        """Zeroed tensors of `shapes` (`cache.zeros`' signature), a store returned before where they match."""
        for i, tensors in enumerate(self.free):
            if [t.shape for t in tensors] == [torch.Size(s) for s in shapes] and tensors[0].dtype == dtype:
                return [t.zero_() for t in self.free.pop(i)]
        tensors = caches.zeros(shapes, dtype, device)
        for t in tensors:
            torch._dynamo.mark_static_address(t, guard=False)  # a graph input that keeps its address
        return tensors

    def give_back(self, tensors: list[Tensor]) -> None:
        self.free = [tensors, *self.free][:self.keep]


def store_lender(model: DiffusionLM) -> StoreLender:
    lender = getattr(model, "_store_lender", None)
    if lender is None:
        lender = model._store_lender = StoreLender()
    return lender


def clock(device: torch.device) -> float:
    """Wall-clock seconds once the device has finished its queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
