"""LLaDA2.2's insert/delete decoding (spec `new_families.md` section 2; the rule of SGLang's `JointThresholdInDel`).

Beside mask -> token (M2T) and token -> token (T2T) edits, the model may write two edit tokens in the answer part
of the current block: DELETE drops the position (the tokens after it move left), SPLIT makes room before the token
that was there (`[MASK, old token]`, the tokens after it move right). The block is then cut or padded with masks
back to its width, so it keeps its columns in the canvas (and the block cache stays exact) while its content
shrinks or grows inside it. Masks made by an edit are "new"; the block's original masks are followed as they move.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dllm.core.params import param

from .base import Commit, Sampler, StepContext, gumbel_argmax, per_row, register, token_probability, top_k_per_row


@register("joint_threshold_indel")
@dataclass
class JointThresholdInDel(Sampler):
    """Joint-threshold decoding with insertions and deletions (LLaDA2.2; SGLang `JointThresholdInDel`). Each step,
    per row: M2T commits the masks above `threshold`, or if fewer than 1 + (new masks) are, the that many most
    confident ones (so at least one original mask is filled); once no original mask is left every mask is filled.
    T2T rewrites decoded answer tokens whose argmax differs, above `edit_threshold`. DELETE/SPLIT re-lay the block.
    After the last original mask, `max_post_edit_steps` more steps may edit; then one cleanup step fills every mask
    with its best token other than DELETE/SPLIT. A block state seen before (an edit loop) has its least confident
    change replaced by that position's best token not yet tried there. A row's block ends at a step that writes
    nothing. Greedy in the reference; `temperature` > 0 draws the tokens instead. The MASK logit is -inf here (the
    loop's rule), so the reference's fallback for a MASK argmax at an original mask never applies."""

    edits = True
    moves_tokens = True  # DELETE and SPLIT shift the block's tokens
    may_commit_nothing = True  # a mask that receives DELETE is dropped and the block pads a new mask at its end
    threshold: float = param(0.5, "commit masks above this probability (mask -> token)", ge=0.0)
    edit_threshold: float = param(0.0, "rewrite a decoded token whose argmax differs above this probability",
                                  ge=0.0)
    max_post_edit_steps: int = param(16, "steps after the block's last original mask before the cleanup step",
                                     ge=0)

    def check_model(self, config) -> str | None:
        if config.mask_id is None:
            return super().check_model(config)
        if config.edit_ids is None:
            return ("it writes the delete and split tokens of an insert/delete model (LLaDA2.2: delete_token_id and "
                    "split_token_id in config.json); use joint_threshold")
        return None

    def step(self, ctx: StepContext) -> Commit:
        mask_id, (delete, split) = ctx.config.mask_id, ctx.config.edit_ids
        old = ctx.canvas[:, ctx.positions]
        answer = ctx.eligible | ctx.editable  # the block's answer part (its prompt part is never touched)
        state = ctx.state
        if ctx.step == 0:
            state.original = ctx.eligible.clone()  # where the block's original masks are, moved with the edits
            state.updates = torch.zeros_like(old[:, 0])
            state.after_masks = torch.zeros_like(old[:, 0])  # steps with no original mask left
            state.done = torch.zeros_like(ctx.eligible[:, 0])
            state.seen = [set() for _ in range(len(old))]  # block states each row has decoded from
            state.tried = [{} for _ in range(len(old))]  # position -> tokens written there
        tokens = gumbel_argmax(ctx.logits, self.temperature, ctx.generators)
        confidence = token_probability(ctx.logits, tokens, ctx.unscored)
        active = ~state.done & answer.any(1)
        masks = ctx.eligible
        originals, new_masks = (state.original & masks).sum(1), (masks & ~state.original).sum(1)
        state.updates += active
        state.after_masks += active & (originals == 0)
        width = masks.shape[1]
        post_edit_steps = per_row(self.max_post_edit_steps, state.updates)
        cleanup = active & ((state.after_masks > post_edit_steps) | (state.updates > width + post_edit_steps))

        high = masks & (confidence > per_row(self.threshold, confidence))
        need = 1 + new_masks
        most = top_k_per_row(confidence, masks, torch.minimum(need, masks.sum(1)))
        m2t = torch.where(((originals == 0) | cleanup)[:, None], masks,
                          torch.where((high.sum(1) >= need)[:, None], high, most))
        t2t = ctx.editable & (confidence > per_row(self.edit_threshold, confidence)) & (tokens != old)
        write = (m2t | t2t) & active[:, None]
        scrub = write & cleanup[:, None] & ((tokens == delete) | (tokens == split))  # cleanup writes no edit token
        if scrub.any():
            plain = ctx.logits.index_fill(-1, torch.tensor([mask_id, delete, split], device=old.device), -torch.inf)
            tokens = torch.where(scrub, plain.argmax(-1), tokens)
        tokens = self._break_loops(ctx, old, tokens, confidence, write, cleanup, active)

        new, original = torch.where(write, tokens, old), state.original
        for b in (write & ((tokens == delete) | (tokens == split))).any(1).nonzero()[:, 0].tolist():
            new[b], original[b] = relay(new[b], old[b], original[b], int(width - answer[b].sum()), mask_id, delete,
                                        split)
        state.done |= (active & ~write.any(1)) | cleanup
        commit = masks & (new != mask_id)
        edit = ctx.editable & (new != old)  # a decoded position may become a mask (SPLIT, or the block closing up)
        return Commit(commit, new, confidence, edit=edit, again=active & ~state.done)

    def _break_loops(self, ctx: StepContext, old: Tensor, tokens: Tensor, confidence: Tensor, write: Tensor,
                     cleanup: Tensor, active: Tensor) -> Tensor:
        """The anti-loop rule: a row whose block state was seen before changes its least confident position to
        the best token not yet written there; then every written token is remembered."""
        state, mask_id = ctx.state, ctx.config.mask_id
        for b in active.nonzero()[:, 0].tolist():
            key = tuple(old[b].tolist())
            changing = (write[b] & (tokens[b] != old[b])).nonzero()[:, 0]
            if key in state.seen[b] and not cleanup[b] and len(changing):
                position = int(changing[confidence[b, changing].argmin()])
                logits = ctx.logits[b, position].clone()
                logits[list(state.tried[b].get(position, ()))] = -torch.inf
                if state.original[b, position] and ctx.eligible[b, position]:
                    logits[mask_id] = -torch.inf
                tokens = tokens.clone()
                tokens[b, position] = logits.argmax()
            state.seen[b].add(key)
            for position in write[b].nonzero()[:, 0].tolist():
                state.tried[b].setdefault(position, set()).add(int(tokens[b, position]))
        return tokens


def relay(new: Tensor, old: Tensor, original: Tensor, prompt: int, mask_id: int, delete: int, split: int
          ) -> tuple[Tensor, Tensor]:
    """One row's block after its edit tokens: the first `prompt` positions unchanged; then DELETE drops its position,
    SPLIT becomes `[MASK, the old token]`, any other token stays; cut or padded with masks to the block's width. The
    original-mask flags move with their tokens (an inserted or padded mask is new)."""
    tokens, flags = old[:prompt].tolist(), original[:prompt].tolist()
    for token, before, flag in zip(new[prompt:].tolist(), old[prompt:].tolist(), original[prompt:].tolist()):
        if token == split:
            tokens += [mask_id, before]
            flags += [False, flag]
        elif token != delete:
            tokens.append(token)
            flags.append(flag)
    width = len(new)
    tokens, flags = tokens[:width] + [mask_id] * (width - len(tokens)), flags[:width] + [False] * (width - len(flags))
    return torch.tensor(tokens, dtype=new.dtype, device=new.device), torch.tensor(flags, device=new.device)
