"""The canvas: a left-padded batch `[pad | prompt | answer | pad]`, its RoPE positions and key mask, which positions
are not yet committed, and the rule that says when a row has finished."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.errors import DllmError
from ..models import DiffusionLM


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
    mask_id: int | None  # a masked model's mask: its positions not yet committed hold it
    uncommitted: Tensor | None = None  # [B, L] bool: positions not yet committed, where a flag says so: a
    # uniform-state model's (they hold random tokens), WeDLM's window (a predicted mask id is a token); else None
    given_up: Tensor | None = None  # [B, L] bool: masks a sampler gave up (`Commit.given_up`): they stay masked and
    # are not pending; None while there are none

    def pending(self, columns: slice | None = None) -> Tensor:
        """[B, L] bool (or those `columns`): positions not yet committed, the masks of a masked model (less the
        ones given up)."""
        columns = slice(None) if columns is None else columns
        if self.uncommitted is not None:
            return self.uncommitted[:, columns]
        masks = self.tokens[:, columns] == self.mask_id
        return masks if self.given_up is None else masks & ~self.given_up[:, columns]

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
            image = getattr(cfg, "image_token_id", None)
            if image is not None and image in ids:
                raise DllmError(f"prompt {row} holds the image token {image}, but this {cfg.arch} model is text only "
                                f"(its vision tower is not loaded); remove the image from the prompt")
        width = max(map(len, prompts))
        length = width + gen_length
        if length > cfg.max_length:
            raise DllmError(f"prompt ({width} tokens) + gen_length ({gen_length}) = {length} exceeds the model's "
                            f"context of {cfg.max_length}; shorten the prompt or lower gen_length")

    @classmethod
    def build(cls, model: DiffusionLM, prompts: list[list[int]], gen_length: int) -> "Canvas":
        """The left-padded canvas of a fresh batch: prompts, then `gen_length` masks each (pad on a uniform-state
        model, where the sampler draws the canvas)."""
        cls.check(model, prompts, gen_length)
        rows = [torch.tensor(list(ids) + [model.config.placeholder_id] * gen_length, dtype=torch.long)
                for ids in prompts]
        return cls.lay_out(model, rows, [len(ids) for ids in prompts], [len(ids) for ids in prompts])

    @classmethod
    def lay_out(cls, model: DiffusionLM, rows: list[Tensor], before: list[int], prompt_lengths: list[int],
                block: int = 1, given_up: list[Tensor | None] | None = None) -> "Canvas":
        """`rows` of tokens (prompt, then answer), padded left and right so that the first `before[b]` tokens of
        every row end at one column: the answer's start in a fresh batch, the current block's when rows joined
        between blocks (`Batch`), and the canvas from there holds whole blocks of `block` columns (so a row's last
        block, cut short where its answer ends, has one width in any batch). RoPE positions count each row's real
        tokens from 0. On a uniform-state model the answer from that column on is not yet committed. `given_up`:
        each row's masks a sampler gave up (or None), which stay given up."""
        cfg, device = model.config, model.device
        left = max(before)
        length = left + -(-max(len(t) - n for t, n in zip(rows, before)) // block) * block
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
        uncommitted = None if cfg.mask_id is not None else answer & (column >= left)
        canvas = cls(tokens.to(device), positions.to(device), key_mask, int(gen_start.min()), gen_start, gen_end,
                     answer, torch.tensor(cfg.stop_ids, device=device), cfg.mask_id, uncommitted)
        if any(g is not None for g in given_up or []):
            canvas.given_up = torch.zeros_like(canvas.tokens, dtype=torch.bool)
            for b, (row, n, g) in enumerate(zip(rows, before, given_up)):
                if g is not None:
                    canvas.given_up[b, left - n:left - n + len(row)] = g
        return canvas

    def take_rows(self, index: Tensor) -> "Canvas":
        """The canvas of the batch rows `index` alone (copies)."""
        return dataclasses.replace(self, tokens=self.tokens[index], positions=self.positions[index],
                                   key_mask=None if self.key_mask is None else self.key_mask[index],
                                   gen_start=self.gen_start[index], gen_end=self.gen_end[index],
                                   answer=self.answer[index],
                                   uncommitted=None if self.uncommitted is None else self.uncommitted[index],
                                   given_up=None if self.given_up is None else self.given_up[index])

    def write(self, written: Tensor, new: Tensor, commit: Tensor, lo: int, hi: int) -> None:
        """Write `new` where `written` `[B, hi - lo]` into the columns `[lo, hi)`; `commit` of them are committed."""
        self.tokens[:, lo:hi] = torch.where(written, new, self.tokens[:, lo:hi])
        if self.uncommitted is not None:  # a fresh tensor: the last plan's copy stays as it was
            self.uncommitted = self.uncommitted.clone()
            self.uncommitted[:, lo:hi] &= ~commit

    def give_up(self, given_up: Tensor, lo: int) -> Tensor:
        """Mark the positions a sampler gave up (`[B, C]` from column `lo`): they stay masked, no longer pending.
        Returns them."""
        if self.given_up is None:
            self.given_up = torch.zeros_like(self.tokens, dtype=torch.bool)
        self.given_up[:, lo:lo + given_up.shape[1]] |= given_up
        return given_up

    def finish_rows(self, finished: Tensor, cfg, final_before: int | None = None) -> Tensor:
        """Mark rows whose answer is complete (its first committed stop token comes before its first position not
        yet committed, and before `final_before`, the first column whose committed tokens may still change) and write
        the filler into their uncommitted positions. Returns the updated `finished`."""
        tokens, length = self.tokens, self.tokens.shape[1]
        column = torch.arange(length, device=tokens.device)
        stops = torch.isin(tokens, self.stop_ids) & self.answer
        if final_before is not None:
            stops &= column < final_before
        if self.uncommitted is not None:  # a random token of a live canvas ends nothing
            stops &= ~self.uncommitted
        first_stop = torch.where(stops, column, length).amin(1)
        masked = self.pending() & self.answer
        done = first_stop < torch.where(masked, column, length).amin(1)  # no stop: first_stop == length
        tokens.masked_fill_(masked & done[:, None], cfg.filler_id)
        return finished | done
