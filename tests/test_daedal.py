"""DAEDAL, gen_length auto (arXiv 2508.00819), against a plain transcription of the authors' `generate`
(Li-Jinsong/DAEDAL `models/LLaDA_DAEDAL.py`): same canvases and same forwards in the spec's fidelity configurations;
its invariants, batches, samplers and refusals."""
import pytest
import torch
import torch.nn.functional as F
from conftest import random_model

import dllm
from dllm import cache as caches
from dllm import samplers
from dllm.core.errors import DllmError
from dllm.engine.loop import decoded
from dllm.engine.text import encode_prompts
from dllm.samplers import Daedal

# prompts of one length (18 tokens with the chat template), so the authors' batch, which attends to a left-padded
# prompt's padding, decodes each row as it would alone
TEXTS = ["reverse: abc12", "add: 0457+0168"]
SMALL = dict(initial_gen_length=8, max_gen_length=32, expansion_factor=2, eos_check_tokens=4)  # configuration (a)


@pytest.fixture(scope="module")
def tiny():
    model, tok = dllm.load("tiny-llada")
    return model, tok, encode_prompts(tok, TEXTS, chat=True)


@pytest.fixture(scope="module")
def rand():
    return random_model("llada-tiny")


def reference_daedal(model, prompts, initial_gen_length=64, max_gen_length=2048, block_length=32,
                     high_conf_threshold=0.9, low_conf_threshold=0.1, expansion_factor=8, eos_confidence_threshold=0.5,
                     expand_eos_confidence_threshold=0.9, eos_check_tokens=32):
    """`generate` at temperature 0 and cfg 0, on a batch of prompts of one length, step by step. Stage 1: forward the
    canvas `[prompt | masks]` (each row's keys up to its own length; a shorter row's columns after it hold EOS);
    the EOS confidence of a row: from its last column back to its first answer column, p(EOS) at the positions whose
    argmax is EOS until `eos_check_tokens` are found, summed, divided by `eos_check_tokens`, as a float32 tensor;
    rows below the threshold and shorter than the maximum grow by `expansion_factor` masks (at most to the maximum),
    until none grows or the longest stays as long; then `eos_check_tokens // 2` EOS tokens after the masks (the
    length at most the maximum). Stage 2, a cursor per row at its answer's start, every forward: argmax and its
    probability; fill the masks of the block `[cursor, min(cursor + B, end))` above the high threshold, else the
    most probable one; a row below the EOS threshold of expansion and shorter than the maximum turns the least
    probable mask of the block below the low threshold, not filled now, into `expansion_factor` masks (its tokens
    rewritten left to right into a canvas as wide as the longest new row, at most the maximum); a cursor skips
    whole blocks without masks; stop when no cursor is inside its row, or a step changed nothing. The one change:
    MASK's logit is -inf (the toolkit never proposes MASK, see `samplers.base`), so their fallback for a block whose
    every prediction is MASK never applies. Returns each row's answer canvas and the forwards."""
    cfg = model.config
    mask, eos = cfg.mask_id, cfg.filler_id
    p, rows = len(prompts[0]), len(prompts)
    assert all(len(ids) == p for ids in prompts)
    nfe = 0

    def forward(x, lengths):
        nonlocal nfe
        nfe += 1
        logits = model(x, (torch.arange(x.shape[1]) < p + lengths[:, None]).long())
        logits[..., mask] = float("-inf")
        return logits

    def eos_confidence(logits, lengths):
        probs, predicted = F.softmax(logits, dim=-1), logits.argmax(-1)
        out = []
        for i in range(rows):
            found = []
            for pos in range(p + int(lengths[i]) - 1, p - 1, -1):
                if len(found) >= eos_check_tokens:
                    break
                if predicted[i, pos] == eos:
                    found.append(probs[i, pos, eos].item())
            out.append(sum(found) / eos_check_tokens)
        return torch.tensor(out)

    lengths = torch.full((rows,), initial_gen_length)
    x = torch.full((rows, p + initial_gen_length), mask)
    x[:, :p] = torch.tensor(prompts)
    while True:  # stage 1
        grow = (eos_confidence(forward(x, lengths), lengths) < eos_confidence_threshold) & (lengths < max_gen_length)
        if not grow.any():
            break
        new = lengths.clone()
        new[grow] = (lengths[grow] + expansion_factor).clamp(max=max_gen_length)
        if new.max() <= lengths.max():
            break
        y = torch.full((rows, p + int(new.max())), eos)
        for i in range(rows):
            y[i, :p + lengths[i]] = x[i, :p + lengths[i]]
            if grow[i]:
                y[i, p + lengths[i]:p + new[i]] = mask
        x, lengths = y, new
    ended = (lengths + eos_check_tokens // 2).clamp(max=max_gen_length)
    y = torch.full((rows, p + int(ended.max())), eos)
    for i in range(rows):
        y[i, :p] = x[i, :p]
        y[i, p:p + lengths[i]] = mask
    x, lengths = y, ended

    cursor = torch.full((rows,), p)
    while (cursor < p + lengths).any():  # stage 2
        total, before = p + lengths, x.clone()
        logits = forward(x, lengths)
        predicted = logits.argmax(-1)
        confidence = F.softmax(logits, dim=-1).gather(-1, predicted[..., None])[..., 0]
        eos_conf = eos_confidence(logits, lengths)
        masked = x == mask
        fill = torch.zeros_like(masked)
        expand = [None] * rows
        for i in range(rows):
            if cursor[i] >= total[i]:
                continue
            block = [j for j in range(int(cursor[i]), min(int(cursor[i]) + block_length, int(total[i]))) if masked[i, j]]
            high = [j for j in block if confidence[i, j] > high_conf_threshold]
            for j in high or [max(block, key=lambda j: confidence[i, j])]:  # torch.sort; ties: the lowest position
                fill[i, j] = True
            if eos_conf[i] >= expand_eos_confidence_threshold or lengths[i] >= max_gen_length:
                continue
            low = [j for j in block if not fill[i, j] and confidence[i, j] < low_conf_threshold]
            if low:
                expand[i] = min(low, key=lambda j: confidence[i, j])  # torch.topk(largest=False)
        x[fill] = predicted[fill]
        if any(j is not None for j in expand):
            new = lengths.clone()
            for i in range(rows):
                if expand[i] is not None:
                    new[i] = min(int(lengths[i]) + expansion_factor - 1, max_gen_length)
            width = p + int(new.max())
            y = torch.full((rows, width), eos)
            for i in range(rows):
                if expand[i] is None:
                    y[i, :p + lengths[i]] = x[i, :p + lengths[i]]
                    continue
                y[i, :p] = x[i, :p]
                write = p
                for j in range(p, p + int(lengths[i])):
                    if write >= width:
                        break
                    if j == expand[i]:
                        y[i, write:min(write + expansion_factor, width)] = mask
                        write = min(write + expansion_factor, width)
                    else:
                        y[i, write] = x[i, j]
                        write += 1
                new[i] = write - p
            x, lengths = y, new
        for i in range(rows):
            while cursor[i] < p + lengths[i]:
                end = min(int(cursor[i]) + block_length, p + int(lengths[i]))
                if (x[i, cursor[i]:end] == mask).any():
                    break
                cursor[i] += block_length
        if x.shape == before.shape and torch.equal(x, before):
            break
    return [x[i, p:p + lengths[i]].tolist() for i in range(rows)], nfe


def ours(model, prompts, length, block_length, sampler="threshold", **kwargs):
    """Each row's answer canvas and the forwards of `decoded` under gen_length auto (every mask decoded, as theirs)."""
    batch = decoded(model, prompts, samplers.SAMPLERS.create(sampler, **kwargs), caches.CACHES.create("none"), length,
                    block_length, stop_early=False)
    return [row.tokens[len(row.prompt):].tolist() for row in batch.rows], batch.finish().nfe


CONFIGS = {
    "a": (dict(SMALL), 4),
    "b_forced_insertions": (dict(SMALL, eos_threshold=0.0, low_threshold=1.0), 4),
    "c_denoise_only": (dict(SMALL, max_gen_length=12), 4),
}
THEIRS = {"initial_gen_length": "initial_gen_length", "max_gen_length": "max_gen_length",
          "eos_threshold": "eos_confidence_threshold", "expand_threshold": "expand_eos_confidence_threshold",
          "low_threshold": "low_conf_threshold", "expansion_factor": "expansion_factor",
          "eos_check_tokens": "eos_check_tokens"}


def reference_args(params: dict, block_length: int) -> dict:
    return {THEIRS[k]: v for k, v in params.items()} | {"block_length": block_length}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_row_alone_equals_the_authors_generate(tiny, name):
    model, _, ids = tiny
    params, block = CONFIGS[name]
    for prompt in ids:
        want = reference_daedal(model, [prompt], **reference_args(params, block))
        assert ours(model, [prompt], Daedal(**params), block) == ([want[0][0]], want[1])
