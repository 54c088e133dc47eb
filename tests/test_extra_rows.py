"""The loop's extra rows (`Sampler.extra_rows`, `ExtraRows`): rows computed in a step's forward beside the canvas
rows, seen by no canvas row, never stored, counted; their logits in `ctx.extra_logits`."""
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from conftest import random_model

import dllm
from dllm import cache as caches
from dllm.engine.guidance import Guidance
from dllm.engine.decoding import decoded
from dllm.engine.text import encode_prompts
from dllm.samplers import ExtraRows
from dllm.samplers.llada import LowConfidence

TEXTS = ["reverse: abc12", "sort: 42,07,19,03", "add: 0457+0168", "copy: k3x9a"]
IDS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
BLOCK = 8


@dataclass
class Mirror(LowConfidence):
    """low_confidence, with a copy of each block row as an extra row that sees every canvas column (its twin
    included) and no extra row: its logits must be the canvas row's own (raw) logits."""

    adds_rows: ClassVar[bool] = True

    def extra_rows(self, canvas, start, end, config):
        width = end - start
        return ExtraRows(tokens=canvas[:, start:end].clone(), columns=torch.arange(start, end),
                         sees_canvas=torch.ones((1, width, canvas.shape[1]), dtype=torch.bool),
                         sees_extra=torch.zeros((width, width), dtype=torch.bool))

    def step(self, ctx):
        ctx.state.seen = getattr(ctx.state, "seen", []) + [(ctx.logits, ctx.extra_logits)]
        return super().step(ctx)


@pytest.fixture(scope="module")
def tiny():
    model, tok = dllm.load("tiny-llada")
    return model, encode_prompts(tok, TEXTS, chat=True)


def run(model, prompts, sampler, cache, block, **kw):
    batch = decoded(model, prompts, sampler, caches.CACHES.create(cache), 4 * block, block, **kw)
    return batch, batch.finish()


def check_mirror(model, prompts, cache, stop_early=True, cfg_scale=0.0, block=BLOCK):
    """Every step's extra logits are the canvas rows' (on a shifted model the next column's: the block's last extra
    row scores the column after the block), the tokens and forwards low_confidence's, and the rows computed
    low_confidence's plus the extra rows (one per block position and canvas row in the forward, and its
    unconditional copy)."""
    kw = dict(stop_early=stop_early, guidance=Guidance(cfg_scale=cfg_scale))
    batch, stats = run(model, prompts, Mirror(), cache, block, **kw)
    plain, plain_stats = run(model, prompts, LowConfidence(), cache, block, **kw)
    shift = model.config.logit_shift
    for logits, extra in batch.state.seen:
        torch.testing.assert_close(extra[:, :block - shift], logits[:, shift:], rtol=1e-4, atol=1e-4)
    assert torch.equal(batch.canvas.tokens, plain.canvas.tokens) and stats.nfe == plain_stats.nfe
    extra_rows = [a - b for a, b in zip(stats.rows_per_layer, plain_stats.rows_per_layer)]
    if stop_early:  # rows left out of a forward compute no extra rows either
        assert 0 < extra_rows[0] < stats.nfe * len(prompts) * block and extra_rows[0] % block == 0
    else:
        assert extra_rows[0] == stats.nfe * len(prompts) * block * (2 if cfg_scale else 1)
    assert len(set(extra_rows)) == 1  # at every layer


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_extra_rows_see_what_canvas_rows_see_and_change_nothing(tiny, cache):
    """Padded rows, rows that stop early (left out of the forward with their extra rows), the store's keys."""
    check_mirror(*tiny, cache)


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_extra_rows_under_guidance_and_on_a_shifted_model(tiny, cache):
    check_mirror(tiny[0], tiny[1], cache, stop_early=False, cfg_scale=1.0)
    check_mirror(random_model("dream-tiny"), IDS, cache, stop_early=False)


@pytest.mark.parametrize("preset", ["fast-dllm-v2-tiny", "nemotron-diffusion-tiny"])
def test_extra_rows_see_no_more_than_a_canvas_row_at_their_column(preset):
    """Block-causal attention (shifted logits) and causal-prefix attention: an extra row sees the canvas as the
    canvas row at its column does, through the exact block cache."""
    model = random_model(preset)
    check_mirror(model, IDS, "block", stop_early=False, block=model.config.block_size or BLOCK)
