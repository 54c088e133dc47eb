"""The decode loop: one for every sampler, cache and model.

canvas `[pad | prompt | MASK x gen_length]` (left-padded batch) -> blocks left to right -> per step: the cache
picks the rows to compute, the model returns aligned logits of the block, the sampler commits tokens -> stop
when every row has finished (a stop token committed with nothing masked before it).
"""
from __future__ import annotations

import numbers
import threading
import time
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import Tensor

from . import cache as caches
from . import samplers as samplers_mod
from .errors import DllmError
from .models import DiffusionLM, Rows
from .models.transformer import visible_keys

if TYPE_CHECKING:
    from .cache import Cache
    from .samplers import Sampler


@dataclass
class Stats:
    """Counted by the loop and the cache, never estimated."""

    nfe: int = 0  # forwards (every model call)
    full_forwards: int = 0  # forwards that recomputed the whole canvas
    gen_tokens: int = 0  # tokens committed by the sampler (filler after a finished answer excluded)
    seconds: float = 0.0
    rows_per_layer: list[int] = field(default_factory=list)  # token rows computed per layer (batch summed)
    cache_bytes: int = 0  # bytes held by the K/V store
    forward_seconds: dict[str, list[float]] = field(default_factory=dict)  # per forward, by kind (profile=True)

    @property
    def tpf(self) -> float:
        """Tokens per forward, per sequence."""
        return self.gen_tokens / max(self.nfe, 1) / max(self.batch, 1)

    @property
    def tokens_per_second(self) -> float:
        return self.gen_tokens / self.seconds if self.seconds > 0 else 0.0

    batch: int = 1

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tpf": self.tpf, "tokens_per_second": self.tokens_per_second}


@dataclass
class Canvas:
    """A left-padded batch canvas and what stays fixed while decoding it."""

    tokens: Tensor  # [B, L]
    positions: Tensor  # [B, L] RoPE positions: real tokens counted from 0 in every row
    key_mask: Tensor | None  # [B, 1, 1, L] bool, None when nothing is padded
    prompt_length: int  # where the earliest row's generation starts (every row's, unless rows joined between blocks)
    gen_start: Tensor  # [B] where each row's generation starts ...
    gen_end: Tensor  # [B] ... and ends (right padding after it, when rows of a batch differ)
    answer: Tensor  # [B, L] bool: the columns between them
    stop_ids: Tensor  # the model's stop ids, on the canvas's device

    @staticmethod
    def check(model: DiffusionLM, prompts: list[list[int]], gen_length: int) -> None:
        """Every prompt can be decoded with `gen_length` answer tokens (else the one-line reason)."""
        cfg = model.config
        if not prompts:
            raise DllmError("no prompts given; pass at least one prompt")
        for row, ids in enumerate(prompts):
            if len(ids) == 0:
                raise DllmError(f"prompt {row} is empty; every prompt needs at least one token")
            bad = next((t for t in ids if not 0 <= t < cfg.vocab_size), None)
            if bad is not None:
                raise DllmError(f"prompt {row} has token id {bad}, outside the model's vocabulary "
                                f"[0, {cfg.vocab_size}); encode it with the model's tokenizer")
        width = max(map(len, prompts))
        length = width + gen_length
        if length > cfg.max_length:
            raise DllmError(f"prompt ({width} tokens) + gen_length ({gen_length}) = {length} exceeds the model's "
                            f"context of {cfg.max_length}; shorten the prompt or lower gen_length")

    @classmethod
    def build(cls, model: DiffusionLM, prompts: list[list[int]], gen_length: int) -> "Canvas":
        """The left-padded canvas of a fresh batch: prompts, then `gen_length` masks each."""
        cls.check(model, prompts, gen_length)
        mask = model.config.mask_id
        rows = [torch.tensor(list(ids) + [mask] * gen_length, dtype=torch.long) for ids in prompts]
        return cls.lay_out(model, rows, [len(ids) for ids in prompts], [len(ids) for ids in prompts])

    @classmethod
    def lay_out(cls, model: DiffusionLM, rows: list[Tensor], before: list[int], prompt_lengths: list[int]
                ) -> "Canvas":
        """`rows` of tokens (prompt, then answer), padded left and right so that the first `before[b]` tokens of
        every row end at one column: the answer's start in a fresh batch, the current block's when rows joined
        between blocks (`Batch`). RoPE positions count each row's real tokens from 0."""
        cfg, device = model.config, model.device
        left = max(before)
        length = left + max(len(t) - n for t, n in zip(rows, before))
        tokens = torch.full((len(rows), length), cfg.pad_id, dtype=torch.long)
        real = torch.zeros((len(rows), length), dtype=torch.bool)
        for b, (row, n) in enumerate(zip(rows, before)):
            tokens[b, left - n:left - n + len(row)] = row
            real[b, left - n:left - n + len(row)] = True
        positions = (real.long().cumsum(1) - 1).clamp(min=0)
        key_mask = None if real.all() else real[:, None, None, :].to(device)
        gen_start = torch.tensor([left - n + p for n, p in zip(before, prompt_lengths)], device=device)
        gen_end = gen_start + torch.tensor([len(t) - p for t, p in zip(rows, prompt_lengths)], device=device)
        column = torch.arange(length, device=device)
        answer = (column >= gen_start[:, None]) & (column < gen_end[:, None])
        return cls(tokens.to(device), positions.to(device), key_mask, int(gen_start.min()), gen_start, gen_end, answer,
                   torch.tensor(cfg.stop_ids, device=device))


def check_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """`value` as an int (any integer type, e.g. numpy's; a bool, float or string is a one-line error naming
    `name`)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise DllmError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise DllmError(f"{name} must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise DllmError(f"{name} must be at most {maximum}, got {value}")
    return value


MAX_SEED = 2**63 - 1  # torch.Generator seeds are 64-bit


def check_seed(seed: Any) -> int:
    return check_int("seed", seed, 0, MAX_SEED)


def check_lengths(gen_length: int, block_length: int, steps: int | None, model_block: bool = False) -> int:
    """Validate the block layout; return steps per block. `model_block`: the block is a block-causal model's
    attention block, so only gen_length can change."""
    check_int("gen_length", gen_length)
    check_int("block_length", block_length)
    if steps is not None:
        check_int("steps", steps)
    if gen_length < 1 or block_length < 1:
        raise DllmError(f"gen_length ({gen_length}) and block_length ({block_length}) must be positive")
    if gen_length % block_length and model_block:
        raise DllmError(f"gen_length ({gen_length}) must be a multiple of the model's attention block "
                        f"({block_length}); e.g. gen_length {-(-gen_length // block_length) * block_length}")
    if gen_length % block_length:
        raise DllmError(f"gen_length ({gen_length}) must be a multiple of block_length ({block_length}); "
                        f"e.g. gen_length {gen_length // block_length * block_length or block_length} "
                        f"or block_length {gen_length}")
    blocks = gen_length // block_length
    steps = gen_length if steps is None else steps
    if steps < blocks or steps > gen_length or steps % blocks:
        raise DllmError(f"steps ({steps}) must be a multiple of the number of blocks ({blocks}) between {blocks} "
                        f"and gen_length ({gen_length})")
    return steps // blocks


def _finish_rows(canvas: Canvas, finished: Tensor, cfg) -> Tensor:
    """Mark rows whose answer is complete (its first stop token comes before its first mask) and write the filler
    into their remaining masks. Returns the updated `finished`."""
    tokens, length = canvas.tokens, canvas.tokens.shape[1]
    column = torch.arange(length, device=tokens.device)
    first_stop = torch.where(torch.isin(tokens, canvas.stop_ids) & canvas.answer, column, length).amin(1)
    masked = (tokens == cfg.mask_id) & canvas.answer
    done = first_stop < torch.where(masked, column, length).amin(1)  # no stop: first_stop == length
    tokens.masked_fill_(masked & done[:, None], cfg.filler_id)
    return finished | done


class Runner:
    """The model over one canvas and its cache store: counted forwards of chosen rows, and one-forward
    verification of drafts on a fork of the store (self-speculative decoding), adopted once one is chosen.

    `compiled`: forwards go through `compiled_run(model)`, their rows as position tensors so that a block step
    keeps one shape from block to block (caches whose rows are slices: none, prefix, dual, block); on a GPU as
    CUDA graphs (`graphed`), whose logits are copied out before the next replay overwrites them."""

    def __init__(self, model: DiffusionLM, canvas: Canvas, cache: Cache, stats: Stats, profile: bool,
                 compiled: bool = False):
        self.model, self.canvas, self.cache = model, canvas, cache
        self.stats, self.profile = stats, profile
        self.run = compiled_run(model) if compiled else model.run
        self.compiled, self.graphed = compiled, compiled and model.device.type == "cuda"
        self.allocate = store_lender(model).take if self.graphed else caches.zeros  # graphs: lasting addresses
        self.kv = cache.new_kv(model, *canvas.tokens.shape, self.allocate)
        self.verified: tuple | None = None  # (drafts, fork, logits, rows) of the last `verify`

    def retire(self) -> None:
        """Give lent stores back (the runner is not used after this)."""
        self._give_back(self.kv)
        if self.verified is not None:
            self._give_back(self.verified[1])

    def _give_back(self, store: caches.PassThrough) -> None:
        if self.graphed and isinstance(store, caches.KVStore):
            store_lender(self.model).give_back(store.tensors)

    def forward(self, lo: int, hi: int, rows: Rows, tokens: Tensor | None = None, kv=None) -> Tensor:
        """Logits of canvas positions `[lo, hi)` for every row of `tokens` (default: the canvas; or copies of
        it, drafts), computing `rows` against the store `kv` (default: the generation's)."""
        model, canvas, cfg = self.model, self.canvas, self.model.config
        tokens = canvas.tokens if tokens is None else tokens
        kv = self.kv if kv is None else kv
        batch, length = canvas.tokens.shape
        copies = tokens.shape[0] // batch
        key_mask, positions = canvas.key_mask, canvas.positions
        if copies > 1:
            positions = positions.repeat_interleave(copies, 0)
            key_mask = None if key_mask is None else key_mask.repeat_interleave(copies, 0)
        shift = cfg.logit_shift
        slots = caches.row_slots(rows, lo - shift, hi - shift, length, model.device).expand(tokens.shape[0], -1)
        if self.compiled and rows.is_slice:
            rows = Rows(torch.arange(length, device=model.device)[rows.index])
        if key_mask is not None and not self.cache.stores_kv:
            key_mask = key_mask[..., rows.index]
        query_positions = caches.gather_rows(positions, rows)
        key_mask = visible_keys(cfg, query_positions, positions if self.cache.stores_kv else query_positions,
                                key_mask)
        began = _clock(model.device) if self.profile else 0.0
        if self.graphed:
            torch.compiler.cudagraph_mark_step_begin()  # the last replay's outputs are no longer read
        logits = self.run(caches.gather_rows(tokens, rows), query_positions, key_mask, kv, rows, slots.clamp(min=0))
        if self.graphed:
            logits = logits.clone()
        if not rows.is_slice and rows.index.dim() == 2:  # rows served from the store predict nothing this step
            logits[slots < 0] = 0.0
        logits[..., cfg.mask_id] = float("-inf")  # a committed position must never stay masked
        computed = rows.index.shape[-1] if not rows.is_slice else len(range(length)[rows.index])
        counter = self.kv  # drafts' forwards on a fork count into the generation's store
        before = counter.rows_per_layer[0]
        counter.count(tokens.shape[0] * computed, tokens.shape[0] * length)
        full = counter.rows_per_layer[0] - before == tokens.shape[0] * length  # layer 0 computed every row
        if self.profile:
            kind = "verify" if copies > 1 else "full" if full else "cached"
            self.stats.forward_seconds.setdefault(kind, []).append(_clock(model.device) - began)
        self.stats.nfe += 1
        self.stats.full_forwards += int(full)
        return logits

    def verify(self, drafts: Tensor, lo: int, hi: int, rows: Rows) -> Tensor:
        """One forward over draft windows `[B, K, hi - lo]` on a fork of the store: the logits
        `[B, K, hi - lo, V]` the next step would see on each draft. The generation's store is not changed."""
        batch, copies = drafts.shape[:2]
        tokens = self.canvas.tokens.repeat_interleave(copies, 0)
        tokens[:, lo:hi] = drafts.flatten(0, 1)
        if self.verified is not None:  # drafts the sampler did not take
            self._give_back(self.verified[1])
        fork = self.kv.fork(copies, self.allocate)  # graphs: the last fork's addresses again
        logits = self.forward(lo, hi, rows, tokens, fork).unflatten(0, (batch, copies))
        self.verified = (drafts, fork, logits, rows)
        return logits

    def adopt(self, choice: Tensor) -> tuple[Tensor, Tensor]:
        """Take draft `choice` `[B]` of the last `verify` into the store; returns the chosen drafts `[B, hi - lo]`
        (for the loop to check against the sampler's commits) and their logits, the next step's."""
        drafts, fork, logits, rows = self.verified
        pick = torch.arange(len(choice), device=choice.device)
        self.kv.adopt(fork, choice, rows.index)
        self._give_back(fork)
        self.verified = None
        return drafts[pick, choice], logits[pick, choice]


def check_policies(model: DiffusionLM, sampler: Sampler, cache: Cache, compile: bool = False) -> None:
    """The sampler, the cache and the model can decode together (else the one-line reason)."""
    cfg = model.config
    if cfg.pad_id == cfg.mask_id:
        raise DllmError("the model's pad id equals its mask id; fix pad_token_id in config.json")
    if cache.needs_next_commits and not sampler.commits_known_ahead:
        known = ", ".join(cls.name for cls in samplers_mod.SAMPLERS if cls.commits_known_ahead)
        raise DllmError(f"cache {cache.name!r} needs a sampler whose next commits are known before the forward "
                        f"({known}); sampler {sampler.name!r} chooses them from the logits")
    if sampler.drafts and not cache.verifies_drafts:
        raise DllmError(f"sampler {sampler.name!r} verifies drafts, which cache {cache.name!r} cannot do "
                        f"without changing its state; use cache none, prefix, dual or (block-causal models) block")
    if sampler.drafts and getattr(cache, "refresh_every", 0):
        raise DllmError(f"sampler {sampler.name!r} verifies drafts inside a block between cache refreshes; use "
                        f"cache {cache.name!r} with refresh_every=0")
    if sampler.reads_decoded_logits and not cache.compiles:  # a cache computing slices covers the whole window
        raise DllmError(f"sampler {sampler.name!r} reads the logits of decoded tokens, which cache {cache.name!r} does "
                        f"not compute; use cache none, prefix or dual")
    if cache.block_causal_only and not cfg.block_size:
        raise DllmError(f"cache {cache.name!r} is exact only under block-causal attention ({cfg.arch} attends to the "
                        f"whole canvas); use prefix or dual")
    if sampler.edits and not cache.block_fresh:
        raise DllmError(f"sampler {sampler.name!r} rewrites decoded tokens, whose keys and values cache "
                        f"{cache.name!r} keeps; use cache none, prefix, dual or (block-causal models) block")
    if cfg.block_size and sampler.commits_past_block:
        raise DllmError(f"sampler {sampler.name!r} commits later blocks from one forward, which a block-causal model "
                        f"({cfg.arch}) predicts only from finished blocks; use another sampler")
    if cfg.block_size and not cache.block_fresh:
        raise DllmError(f"cache {cache.name!r} chooses rows for full attention; on a block-causal model "
                        f"({cfg.arch}) use cache block (exact), none, prefix or dual")
    check_compile(cache, compile)
    if compile and cfg.moe is not None and model.dtype != torch.bfloat16:
        raise DllmError(f"MoE layers ({cfg.arch}) compile in bfloat16 only (torch's grouped matmul traces for no "
                        f"other type); use --dtype bfloat16 or drop --compile")


def check_block_layout(model: DiffusionLM, block_length: int) -> None:
    size = model.config.block_size
    if size and block_length != size:
        raise DllmError(f"block_length ({block_length}) must equal the model's attention block ({size}) on a "
                        f"block-causal model ({model.config.arch}); use --block-length {size}")


def check_compile(cache: Cache, compile: bool) -> None:
    if compile and not cache.compiles:
        raise DllmError(f"cache {cache.name!r} chooses its rows token by token and runs eagerly; drop --compile "
                        f"(compile=False) or use cache none, prefix, dual or (block-causal models) block")


# A model's floats (RMSNorm eps) are compiled in as constants: a layer region (`Block`) takes tensors only, and
# without this a second model with another eps would pass it as a float. The patch is one object that sets torch's
# process-wide config, so one thread at a time holds it.
_CONSTANT_FLOATS = torch._dynamo.config.patch(specialize_float=True)
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

        def run(*args):
            with _CONSTANT_FLOATS_LOCK, _CONSTANT_FLOATS:
                return compiled(*args)
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

    def take(self, count: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> list[Tensor]:
        """`count` zeroed tensors (`cache.zeros`' signature), a store returned before where they match."""
        for i, tensors in enumerate(self.free):
            if len(tensors) == count and tensors[0].shape == shape and tensors[0].dtype == dtype:
                return [t.zero_() for t in self.free.pop(i)]
        tensors = caches.zeros(count, shape, dtype, device)
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


@dataclass(eq=False)  # a row is itself: compared and hashed by identity
class Row:
    """One prompt in a `Batch`: its tokens (prompt, then its answer canvas) and its own random stream, so its
    tokens never depend on the rows beside it."""

    prompt: list[int]
    gen_length: int  # answer positions
    origin: int  # where its first block starts: the answer (len(prompt)), or on a block-causal model the
    # attention block the prompt ends in, so that decoded blocks are the model's blocks (SDAR's layout)
    generator: torch.Generator
    tokens: Tensor  # [len(prompt) + gen_length] as of the last layout
    decoded: int = 0  # positions from `origin` before the current block (whole blocks), as of the last layout
    finished: bool = False  # a stop token committed with nothing masked before it


class Batch:
    """Rows decoded together, block by block, all with the same sampler, cache and block layout: the one decode
    loop. `decode` runs a fixed batch to the end; `dllm serve` also adds and removes rows between blocks
    (continuous batching), which re-lays the canvas out so that every row's current block sits at the same
    columns: `[pad | prompt | decoded blocks | current block | later blocks | pad]`. That is exact when the cache
    recomputes every row at a block start (`Cache.block_fresh`) and the sampler looks only at the current block
    (`Sampler.block_local`); `joins_between_blocks` says so.

    `profile` times every forward into `stats.forward_seconds`; `callback` is called after every step with
    `{"block", "step", "committed"}`; `compile` runs the model compiled (`compiled_run`; caches none, prefix, dual).
    The host waits for the device once per step (has the block any mask left?) and once per block."""

    def __init__(self, model: DiffusionLM, sampler: Sampler, cache: Cache, block_length: int, steps_per_block: int,
                 stop_early: bool = True, trace: bool = False, profile: bool = False,
                 callback: Callable[[dict], None] | None = None, compile: bool = False):
        check_policies(model, sampler, cache, compile)
        check_block_layout(model, block_length)
        self.model, self.sampler, self.cache = model, sampler, cache
        self.block_length, self.steps_per_block = block_length, steps_per_block
        self.stop_early, self.profile, self.callback, self.compile = stop_early, profile, callback, compile
        self.joins_between_blocks = sampler.block_local and cache.block_fresh
        self.rows: list[Row] = []
        self.stats, self.trace = Stats(batch=0, rows_per_layer=[0] * model.config.n_layers), [] if trace else None
        self.canvas: Canvas | None = None  # None: rows changed since the last layout
        self.runner: Runner | None = None
        self._saved = True  # the rows hold what the canvas holds
        self.block = 0  # blocks run

    def add(self, prompt: list[int], gen_length: int, seed: int = 0) -> Row:
        """A row for `prompt` with `gen_length` answer tokens (whole blocks), decoded from the next block on."""
        if self.rows and not self.joins_between_blocks and self.block:
            raise DllmError(f"sampler {self.sampler.name!r} with cache {self.cache.name!r} cannot take rows into a "
                            f"running batch (the sampler must look only at the current block and the cache "
                            f"recompute every row at each block start); start a new batch")
        if gen_length % self.block_length:
            raise DllmError(f"gen_length ({gen_length}) must be a multiple of block_length ({self.block_length})")
        model, size = self.model, self.model.config.block_size
        Canvas.check(model, [prompt], gen_length)
        origin = len(prompt)
        if size:  # whole attention blocks, the answer from the prompt's end to the end of its last block
            origin = len(prompt) // size * size
            gen_length = -(-(len(prompt) + gen_length) // size) * size - len(prompt)
        tokens = torch.tensor(list(prompt) + [model.config.mask_id] * gen_length, dtype=torch.long)
        row = Row(list(prompt), gen_length, origin, torch.Generator(device=model.device).manual_seed(seed), tokens)
        self._save()
        self.rows.append(row)
        self.canvas = None
        return row

    def remove(self, row: Row) -> None:
        """Take `row` out between blocks (finished, out of blocks, or cancelled)."""
        if not self.joins_between_blocks and self.block:
            raise DllmError(f"sampler {self.sampler.name!r} with cache {self.cache.name!r} cannot drop rows from a "
                            f"running batch; let it finish")
        self._save()
        self.rows.remove(row)
        self.canvas = None

    def cancel(self, row: Row) -> None:
        """Stop decoding `row` from the next step on (take it out between blocks with `remove`)."""
        if self.canvas is None:
            row.finished = True
        else:
            self.finished[self.rows.index(row)] = True
            self._saved = False

    def answer(self, row: Row) -> list[int]:
        """`row`'s answer so far: the tokens of its decoded blocks (of all of them once it has finished: a sampler
        such as Prophet may fill later blocks early), cut before the first stop token."""
        self._save()
        ids = row.tokens[len(row.prompt):len(row.tokens) if row.finished else row.origin + row.decoded].tolist()
        stops = self.model.config.stop_ids
        return ids[:next((i for i, t in enumerate(ids) if t in stops), len(ids))]

    def done(self, row: Row) -> bool:
        """Nothing left to decode: a stop committed, or every block of the row decoded."""
        self._save()
        return row.finished or row.origin + row.decoded >= len(row.prompt) + row.gen_length

    @property
    def running(self) -> bool:
        return any(not self.done(row) for row in self.rows)

    def _save(self) -> None:
        """Copy the canvas back into the rows (their tokens, decoded blocks and finished flags)."""
        canvas = self.canvas
        if canvas is None or self._saved:
            return
        finished = self.finished.tolist()
        for b, row in enumerate(self.rows):
            first = int(canvas.gen_start[b]) - len(row.prompt)
            row.tokens = canvas.tokens[b, first:first + len(row.tokens)].clone()
            row.decoded = min(self.start - first - row.origin, len(row.tokens) - row.origin)
            row.finished = finished[b]
        self._saved = True

    def _layout(self) -> None:
        """Lay the rows out on a fresh canvas, current blocks aligned, with a fresh store and sampler state."""
        model, rows = self.model, self.rows
        before = [row.origin + row.decoded for row in rows]  # tokens left of the current block
        self.canvas = Canvas.lay_out(model, [row.tokens for row in rows], before, [len(row.prompt) for row in rows])
        self.start, self._saved = max(before), False
        self._count_store()
        self.runner = Runner(model, self.canvas, self.cache, self.stats, self.profile, self.compile)
        self.stats.batch = max(self.stats.batch, len(rows))
        self.state = SimpleNamespace()  # the sampler's per-run state
        self.generators = [row.generator for row in rows]
        self.finished = torch.tensor([row.finished for row in rows], dtype=torch.bool, device=model.device)
        self.masked_at_plan = None  # the canvas's masks when the last forward was planned

    def _count_store(self) -> None:
        """Add the retiring store's row counts to the statistics."""
        if self.runner is not None:
            kv = self.runner.kv
            self.stats.rows_per_layer = [a + b for a, b in zip(kv.rows_per_layer, self.stats.rows_per_layer)]
            self.stats.cache_bytes = max(self.stats.cache_bytes, kv.nbytes)
            self.runner.retire()
            self.runner = None

    def finish(self) -> Stats:
        """The statistics of everything decoded (call after the last block)."""
        self._count_store()
        return self.stats

    @torch.no_grad()
    def run_block(self) -> None:
        """Decode the next block of every row."""
        if not self.rows:
            raise DllmError("the batch has no rows; add a prompt first")
        if self.canvas is None:
            self._layout()
        model, sampler, cache, canvas, runner = self.model, self.sampler, self.cache, self.canvas, self.runner
        cfg, stats, kv = model.config, self.stats, self.runner.kv
        family = "dream" if cfg.logit_shift else "llada"  # for the defaults papers set per family
        batch, length = canvas.tokens.shape
        prompt_length, start, block = canvas.prompt_length, self.start, self.block
        total_steps = self.steps_per_block * -(-int((canvas.gen_end - canvas.gen_start).max()) // self.block_length)
        committed = torch.zeros((), dtype=torch.long, device=model.device)

        def plan(step: int, start: int, end: int) -> tuple[int, int, Rows]:
            """Candidate window `[lo, hi)` of a step and the rows to compute for it."""
            lo, hi = sampler.logit_window(prompt_length, length, start, end, step)
            lo, hi = min(lo, start), max(hi, end)
            masked = canvas.tokens == cfg.mask_id
            decoded = None if self.masked_at_plan is None else self.masked_at_plan & ~masked
            self.masked_at_plan = masked
            next_commits = sampler.next_commits(self.state) if cache.needs_next_commits else None
            return lo, hi, cache.plan(kv, caches.PlanContext(
                canvas=canvas, masked=masked, decoded=decoded, next_commits=next_commits, step=step, start=start,
                end=end, lo=lo, hi=hi, shift=cfg.logit_shift, family=family))

        def open_rows(start: int, end: int, again: Tensor | None = None) -> Tensor:
            """[B] rows with a mask left in the block, or (token editing) asking for another step."""
            masks_left = ((canvas.tokens[:, start:end] == cfg.mask_id) & ~self.finished[:, None]).any(1)
            return masks_left if again is None else masks_left | (again & ~self.finished)

        start_time = _clock(model.device)
        end = min(start + self.block_length, length)
        step, reused = 0, None  # reused: (window, logits) of a verified draft the sampler committed
        open_now = open_rows(start, end).tolist()
        while any(open_now):
            # a row draws random numbers only at its own steps (when it has masks left), as it does alone
            generators = [g if o else None for g, o in zip(self.generators, open_now)]
            counted = list(kv.rows_per_layer) if self.trace is not None else None
            lo, hi, rows = plan(step, start, end)
            logits = reused[1] if reused is not None and reused[0] == (lo, hi) else runner.forward(lo, hi, rows)
            masked = self.masked_at_plan[:, lo:hi] & ~self.finished[:, None]  # the forward left the tokens as planned
            positions = torch.arange(lo, hi, device=model.device)

            def verify(drafts: Tensor, step=step, start=start, end=end, lo=lo, hi=hi) -> Tensor:
                next_lo, next_hi, next_rows = plan(step + 1, start, end)  # refreshes mid-block: refused up front
                if (next_lo, next_hi) != (lo, hi):
                    raise DllmError(f"sampler {sampler.name!r} verifies drafts with the logits of the next step, "
                                    f"so its logit_window must not change inside a block")
                return runner.verify(drafts, lo, hi, next_rows)

            in_block = (positions >= start) & (positions < end)
            editable = None
            if sampler.edits:  # decoded answer tokens of this block; never the prompt (its tail shares the block)
                decoded = (canvas.tokens[:, lo:hi] != cfg.mask_id) & ~self.finished[:, None]
                editable = decoded & in_block & (positions >= canvas.gen_start[:, None])
            ctx = samplers_mod.StepContext(
                logits=logits, eligible=masked & in_block, masked=masked,
                positions=positions, canvas=canvas.tokens, step=step, steps=self.steps_per_block, block=block,
                generators=generators, nfe=stats.nfe - 1, total_steps=total_steps, block_start=start,
                block_end=end, prompt_length=prompt_length, state=self.state,
                forward=verify if sampler.drafts else None, editable=editable,
                family=family)
            if step == 0:  # the block-start forward may move the block end (AdaBlock)
                end = sampler.block_end(ctx)
                if not start < end <= length:
                    raise DllmError(f"sampler {sampler.name!r} chose block end {end} outside ({start}, {length}]")
                ctx.block_end = end
                ctx.eligible = masked & (positions >= start) & (positions < end)
            out = sampler.step(ctx)
            if not isinstance(out, samplers_mod.Commit):
                raise DllmError(f"sampler {sampler.name!r} returned {type(out).__name__} from step; return a "
                                f"Commit(mask, tokens, confidence)")
            commit = out.mask & masked
            stalled = (ctx.eligible.any(1) & ~(commit & ctx.eligible).any(1)).any() & (not sampler.may_commit_nothing)
            written = commit if editable is None or out.edit is None else commit | (out.edit & editable)
            canvas.tokens[:, lo:hi] = torch.where(written, out.tokens, canvas.tokens[:, lo:hi])
            checks, reused = [stalled], None
            if out.verified is not None:
                draft, draft_logits = runner.adopt(out.verified)
                checks.append((draft != canvas.tokens[:, lo:hi]).any())  # the draft differs from the commits
                reused = ((lo, hi), draft_logits)
            committed += commit.sum()
            if self.trace is not None:
                rows_per_layer = [now - before for now, before in zip(kv.rows_per_layer, counted)]
                self.trace.append(_trace_step(block, step, rows_per_layer, positions, commit, out, logits))
            if self.stop_early:
                self.finished = _finish_rows(canvas, self.finished, cfg)
            if self.callback is not None:
                self.callback({"block": block, "step": step, "committed": int(commit.sum())})
            flags = torch.cat([open_rows(start, end, out.again), torch.stack(checks)]).tolist()  # one device wait
            open_now, (stalled, *diverged) = flags[:batch], flags[batch:]
            if stalled:
                raise DllmError(f"sampler {sampler.name!r} committed nothing for an unfinished row at block "
                                f"{block} step {step}; a sampler must commit at least one position per row")
            if any(diverged):
                raise DllmError("a sampler returned a verified draft that differs from its commits; commit exactly "
                                "the chosen draft")
            step += 1
        self.start, self.block, self._saved = end, block + 1, False
        stats.seconds += _clock(model.device) - start_time
        stats.gen_tokens += int(committed)


@torch.no_grad()
def decode(model: DiffusionLM, prompts: list[list[int]], sampler: Sampler, cache: Cache, gen_length: int,
           block_length: int, steps: int | None = None, seed: int | list[int] = 0, stop_early: bool = True,
           trace: bool = False, profile: bool = False, callback: Callable[[dict], None] | None = None,
           compile: bool = False) -> tuple[Canvas, Stats, list[dict] | None]:
    """Decode token-id prompts as one fixed batch (every row seeded with `seed`, or row i with `seed[i]`); returns
    the final canvas, statistics and (optionally) a per-step trace. `profile` times every forward (synchronizing
    the device) into `stats.forward_seconds` by kind: `full` (every canvas row computed), `cached` (the other
    rows read from the cache), `verify` (draft batches). See `Batch` for `callback` and `compile`."""
    steps_per_block = check_lengths(gen_length, block_length, steps)
    Canvas.check(model, prompts, gen_length)  # every prompt's error before any work
    batch = Batch(model, sampler, cache, block_length, steps_per_block, stop_early, trace, profile, callback, compile)
    for ids, row_seed in zip(prompts, seed if isinstance(seed, list) else [seed] * len(prompts)):
        batch.add(ids, gen_length, row_seed)
    while batch.running:
        batch.run_block()
    return batch.canvas, batch.finish(), batch.trace


def _clock(device: torch.device) -> float:
    """Wall-clock seconds once the device has finished its queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _trace_step(block, step, rows_per_layer, candidates, commit, out, logits) -> dict:
    top2 = torch.softmax(logits.double(), -1).topk(2, dim=-1).values
    gap = top2[..., 0] - top2[..., 1]
    return {"block": block, "step": step, "rows_per_layer": rows_per_layer,
            "commits": [[{"position": int(candidates[c]), "token": int(out.tokens[b, c]),
                          "confidence": float(out.confidence[b, c]), "top2_gap": float(gap[b, c])}
                         for c in commit[b].nonzero()[:, 0].tolist()] for b in range(commit.shape[0])]}


@dataclass
class Generation:
    texts: list[str]
    token_ids: list[list[int]]  # generated ids of each row, cut before the first stop token
    sequences: Tensor  # the final canvas [B, L], prompt included
    stats: Stats
    sampler: dict[str, Any]
    cache: dict[str, Any]
    trace: list[dict] | None = None


def encode_prompts(tokenizer, prompts, chat: bool | None) -> list[list[int]]:
    """Token ids of each prompt (a string, or a list of token ids); `chat` wraps a string as a user turn with
    the tokenizer's chat template. Characters the tokenizer does not know are an error, never a silent unk."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise DllmError(f"prompts must be a string or a non-empty list of strings or token-id lists, got {prompts!r}")
    if chat is not None and not isinstance(chat, bool):
        raise DllmError(f"chat must be True, False or None (the tokenizer decides), got {chat!r}")
    if chat is None:
        chat = getattr(tokenizer, "chat_template", None) is not None
    if chat and getattr(tokenizer, "chat_template", None) is None:
        raise DllmError("this tokenizer has no chat template; pass chat=False (--no-chat)")
    out = []
    for row, p in enumerate(prompts):
        if isinstance(p, str):
            out.append(_encode_text(tokenizer, p, row, chat))
        elif isinstance(p, (list, tuple, Tensor)) and all(_is_int(t) for t in p):
            out.append([int(t) for t in p])
        else:
            raise DllmError(f"prompt {row} is {p!r}; a prompt is a string or a list of token ids "
                            f"(wrap one prompt's ids in a list: [[1, 2, 3]])")
    return out


def _is_int(t) -> bool:
    return (isinstance(t, int) and not isinstance(t, bool)) or (isinstance(t, Tensor) and t.dim() == 0
                                                                 and not t.dtype.is_floating_point)


def check_plain_text(tokenizer, text: str, what: str) -> None:
    """Text that goes into the chat template must not hold the tokenizer's special tokens: `<|eot_id|>` typed in
    a prompt would end the user's turn (a template injection), `<|mdm_mask|>` would be a mask."""
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    special = [*getattr(tokenizer, "all_special_tokens", []), *(t.content for t in added if t.special)]
    found = next((s for s in special if s and s in text), None)
    if found is not None:
        raise DllmError(f"{what} contains the special token {found!r}, which the chat template would read as a "
                        f"control token; remove it (chat=False / --no-chat sends raw text as it is)")


def _encode_text(tokenizer, text: str, row: int, chat: bool) -> list[int]:
    if not text.strip():
        raise DllmError(f"prompt {row} is empty; give some text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise DllmError(f"prompt {row} is not valid UTF-8 text; convert it to UTF-8") from None
    if chat:
        check_plain_text(tokenizer, text, f"prompt {row}")
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return encode_text(tokenizer, text, f"prompt {row}")


def encode_text(tokenizer, text: str, what: str) -> list[int]:
    """Token ids of `text` as it is (no special tokens added); characters the tokenizer does not know are an error
    naming `what`, never a silent unk (the tiny models' unk is their end of text)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None or not getattr(tokenizer, "is_fast", False):  # byte-level BPE (the real models) has no unk
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    unknown = sorted({text[a:b] for t, (a, b) in zip(enc["input_ids"], enc["offset_mapping"])
                      if t == unk and text[a:b] != tokenizer.unk_token})
    if unknown:
        raise DllmError(f"{what} has characters the tokenizer does not know: "
                        f"{', '.join(map(repr, unknown))}; remove or replace them")
    return enc["input_ids"]


def split_params(sampler: str | Sampler, cache: str | Cache, params: dict[str, Any],
                 sampler_args: dict[str, Any] | None = None, cache_args: dict[str, Any] | None = None):
    """Build the sampler and the cache. `params` are routed by name and override `sampler_args`/`cache_args`;
    a name that both take must go through those instead (never a silent choice); unknown names are an error."""
    for name, args in (("sampler_args", sampler_args), ("cache_args", cache_args)):
        if args is not None and not isinstance(args, dict):
            raise DllmError(f"{name} must be a dict of parameters, got {args!r}")
    sampler_cls = type(sampler) if isinstance(sampler, samplers_mod.Sampler) else samplers_mod.SAMPLERS.get(sampler)
    cache_cls = type(cache) if isinstance(cache, caches.Cache) else caches.CACHES.get(cache)
    both = sorted(set(params) & set(sampler_cls.param_names()) & set(cache_cls.param_names()))
    if both:
        raise DllmError(f"parameter {both[0]!r} is taken by both sampler {sampler_cls.name!r} and cache "
                        f"{cache_cls.name!r}; say which with sampler_args={{...}} or cache_args={{...}} "
                        f"(CLI: --sampler-arg or --cache-arg)")
    s_args = {**(sampler_args or {}), **{k: v for k, v in params.items() if k in sampler_cls.param_names()}}
    c_args = {**(cache_args or {}), **{k: v for k, v in params.items() if k in cache_cls.param_names()}}
    unknown = sorted(set(params) - set(sampler_cls.param_names()) - set(cache_cls.param_names()))
    if unknown:
        raise DllmError(f"unknown parameter {unknown[0]!r} for sampler {sampler_cls.name!r} and cache "
                        f"{cache_cls.name!r}; sampler takes {', '.join(sampler_cls.param_names())}, cache takes "
                        f"{', '.join(cache_cls.param_names()) or 'nothing'}")
    return samplers_mod.SAMPLERS.create(sampler, **s_args), caches.CACHES.create(cache, **c_args)


def default_cache(model: DiffusionLM) -> str:
    """The cache used when none is named: on a block-causal model the exact finished-block cache (the tokens of
    recomputing everything, far fewer rows computed), else none (the papers' vanilla decoding)."""
    return "block" if model.config.block_size else "none"


DEFAULT_GEN_LENGTH = 64  # answer tokens: the canvas the shipped tiny models were trained on (48..64)
DEFAULT_BLOCK_LENGTH = 32


def decoding_lengths(model: DiffusionLM, gen_length: int | None = None, block_length: int | None = None,
                     steps: int | None = None) -> dict[str, int | None]:
    """gen_length, block_length and steps to decode with: the caller's, else the model directory's
    (`generation_config.json`), else ours (block_length: a block-causal model's attention block). Validated, so a
    bad value fails before any work."""
    own, from_file = getattr(model, "generation_defaults", {}), []

    def from_own(name: str, given):
        if given is None and name in own:
            from_file.append(name)
            return own[name]
        return given

    gen_length = from_own("gen_length", gen_length)
    gen_length = DEFAULT_GEN_LENGTH if gen_length is None else gen_length
    block_length = from_own("block_length", block_length)
    if block_length is None:  # a block-causal model decodes in its attention blocks; others in blocks of 32, or
        # of the largest size below that divides the answer (gen_length 48 alone: blocks of 24)
        block_length = model.config.block_size or _default_block(gen_length)
    if "gen_length" in from_file:  # the file's steps belong to the file's length
        steps = from_own("steps", steps)
    try:
        check_lengths(gen_length, block_length, steps, model_block=block_length == model.config.block_size)
    except DllmError as e:
        if not from_file:
            raise
        raise DllmError(f"{e} ({' and '.join(from_file)} from the model's generation_config.json)") from None
    return {"gen_length": gen_length, "block_length": block_length, "steps": steps}


def _default_block(gen_length) -> int:
    if isinstance(gen_length, bool) or not isinstance(gen_length, int) or gen_length < 1:
        return DEFAULT_BLOCK_LENGTH  # check_lengths names the problem
    return max(b for b in range(1, min(gen_length, DEFAULT_BLOCK_LENGTH) + 1) if gen_length % b == 0)


def lengths_for_answer(lengths: dict[str, int | None], max_tokens: int | None) -> dict[str, int | None]:
    """Decoding lengths (`decoding_lengths`) for an answer of at most `max_tokens` tokens: the canvas in whole
    blocks, the same steps per token; the caller cuts the answer at `max_tokens`."""
    lengths = dict(lengths)
    if max_tokens:
        block, gen, steps = lengths["block_length"], lengths["gen_length"], lengths["steps"]
        lengths["gen_length"] = new = -(-int(max_tokens) // block) * block
        if steps is not None:
            blocks = new // block
            lengths["steps"] = min(new, max(1, round(steps * new / gen / blocks)) * blocks)
    return lengths


def answer_text(tokenizer, ids: list[int]) -> str:
    """The text of answer token ids (ids past the tokenizer's vocabulary, a padded embedding's, are dropped)."""
    return tokenizer.decode([t for t in ids if t < len(tokenizer)], skip_special_tokens=True)


def _prepare(model: DiffusionLM, tokenizer, prompts, sampler, cache, gen_length, block_length, steps, seed, chat,
             flags: dict[str, Any], sampler_args, cache_args, params):
    """`generate`'s and `stream`'s checks and setup: the sampler and cache, the lengths, the seed and flags, then
    the prompts' ids (every bad input fails before any work)."""
    sampler, cache = split_params(sampler, default_cache(model) if cache is None else cache, params, sampler_args,
                                  cache_args)
    lengths = decoding_lengths(model, gen_length, block_length, steps)
    for row_seed in seed if isinstance(seed, list) else [seed]:
        check_seed(row_seed)
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise DllmError(f"{name} must be True or False, got {flag!r}")
    ids = encode_prompts(tokenizer, prompts, chat)
    if isinstance(seed, list) and len(seed) != len(ids):
        raise DllmError(f"seed is a list of {len(seed)} seeds for {len(ids)} prompts; give one per prompt or one int")
    sampler.prepare(tokenizer)
    return sampler, cache, lengths, ids


def generate(model: DiffusionLM, tokenizer, prompts, sampler: str | Sampler = "low_confidence",
             cache: str | Cache | None = None, gen_length: int | None = None, block_length: int | None = None,
             steps: int | None = None, seed: int | list[int] = 0, chat: bool | None = None, stop_early: bool = True,
             trace: bool = False, sampler_args: dict[str, Any] | None = None,
             cache_args: dict[str, Any] | None = None, callback: Callable[[dict], None] | None = None,
             compile: bool = False, **params: Any) -> Generation:
    """Generate answers for a batch of prompts (strings, or lists of token ids).

    `params` go to the sampler or the cache by name (e.g. `threshold=0.9`, `temperature=0.5`,
    `refresh_every=4`); a name both take goes in `sampler_args`/`cache_args`. Every row draws from its own
    generator seeded with `seed` (a row equals its prompt alone), or with `seed[i]`: several samples of one
    prompt in one batch take a list of seeds. `cache` defaults to `default_cache(model)` (block-causal models:
    `block`; others: `none`). gen_length and block_length default to the model directory's
    `generation_config.json`, else 64 and 32 (or the largest block below 32 that divides gen_length); steps to
    gen_length (one token per step for schedule-driven samplers). `callback` is called after every step (see
    `decode`). `compile` runs the model under `torch.compile` (caches none, prefix, dual, block; the first calls
    compile, minutes on a CPU for a large model)."""
    sampler, cache, lengths, ids = _prepare(model, tokenizer, prompts, sampler, cache, gen_length, block_length,
                                            steps, seed, chat, dict(stop_early=stop_early, trace=trace,
                                                                    compile=compile), sampler_args, cache_args, params)
    canvas, stats, steps_trace = decode(model, ids, sampler, cache, **lengths, seed=seed, stop_early=stop_early,
                                        trace=trace, callback=callback, compile=compile)
    cfg = model.config
    token_ids = []
    for row, a, b in zip(canvas.tokens.tolist(), canvas.gen_start.tolist(), canvas.gen_end.tolist()):
        row = row[a:b]
        token_ids.append(row[:next((i for i, t in enumerate(row) if t in cfg.stop_ids), len(row))])
    return Generation([answer_text(tokenizer, ids) for ids in token_ids], token_ids, canvas.tokens, stats,
                      sampler.config(), cache.config(), steps_trace)


class Stream:
    """One prompt's answer while it is decoded (`stream`): iterating yields the text each decoded block adds;
    afterwards `generation` holds what `generate` returns for the prompt alone."""

    def __init__(self, tokenizer, batch: Batch, row: Row):
        self.tokenizer, self.batch, self.row = tokenizer, batch, row
        self.generation: Generation | None = None

    def __iter__(self):
        batch, text = self.batch, ""
        while batch.running:
            batch.run_block()
            ids = batch.answer(self.row)
            new = answer_text(self.tokenizer, ids)
            if not batch.running or not new.endswith("\ufffd"):  # a character split between blocks waits
                if new[len(text):]:
                    yield new[len(text):]
                text = new
        if self.generation is None:
            self.generation = Generation([text], [ids], batch.canvas.tokens, batch.finish(), batch.sampler.config(),
                                         batch.cache.config(), batch.trace)


def stream(model: DiffusionLM, tokenizer, prompt, sampler: str | Sampler = "low_confidence",
           cache: str | Cache | None = None, gen_length: int | None = None, block_length: int | None = None,
           steps: int | None = None, seed: int = 0, chat: bool | None = None, stop_early: bool = True,
           trace: bool = False, sampler_args: dict[str, Any] | None = None,
           cache_args: dict[str, Any] | None = None, callback: Callable[[dict], None] | None = None,
           compile: bool = False, **params: Any) -> Stream:
    """`generate` for one prompt, its answer's text given block by block as it is decoded:

        s = dllm.stream(model, tok, "reverse: abc", sampler="threshold", cache="dual")
        for text in s: print(text, end="", flush=True)
        s.generation.stats.nfe

    The tokens are `generate`'s for that prompt (the same loop); a block's text appears once the block is
    decoded (blocks are final, left to right)."""
    one = isinstance(prompt, str) or isinstance(prompt, (list, tuple, Tensor)) and all(_is_int(t) for t in prompt)
    if not one:
        raise DllmError(f"stream takes one prompt (a string or a list of token ids), got {prompt!r}; "
                        f"use generate for a batch")
    sampler, cache, lengths, ids = _prepare(model, tokenizer, [prompt], sampler, cache, gen_length, block_length,
                                            steps, seed, chat, dict(stop_early=stop_early, trace=trace,
                                                                    compile=compile), sampler_args, cache_args, params)
    steps_per_block = check_lengths(lengths["gen_length"], lengths["block_length"], lengths["steps"])
    batch = Batch(model, sampler, cache, lengths["block_length"], steps_per_block, stop_early, trace,
                  callback=callback, compile=compile)
    return Stream(tokenizer, batch, batch.add(ids[0], lengths["gen_length"], seed[0] if isinstance(seed, list)
                                              else seed))
