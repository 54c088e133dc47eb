"""DUS (`samplers/dus.py`; arXiv 2506.19037) against a plain transcription of omerlux/DUS `generate_scheduled` (its
early stop on stop tokens off), token for token and forward for forward (spec `strategies_2026.md`, fidelity
configurations); its plans against transcriptions of `dilated_unmask_levels`, `binary_search_levels` and
`merge_last_level`; and what a row that ends with masks (positions given up) does in answers, stop detection,
traces, continuous batching, logprobs and `dllm serve`."""
import functools

import pytest
import torch
from conftest import random_model

import dllm
from dllm import cache as caches
from dllm import samplers
from dllm.core.errors import DllmError
from dllm.engine import Batch
from dllm.engine.text import encode_prompts
from dllm.samplers.dus import levels_of

PROMPTS = ["reverse: abc12", "sort: 42,07,19,03", "add: 0457+0168", "copy: k3x9a"]
TRAINED, RANDOM = ["tiny-llada", "tiny-dream"], ["llada-tiny", "dream-tiny"]


@functools.cache
def loaded(name: str):
    """The shipped tiny models (realistic confidences) and random ones (confidences near 1/V: a threshold gives up
    every position of a level but the last's)."""
    if name.startswith("tiny-"):
        return dllm.load(name)
    return random_model(name), dllm.load(f"random:{name}")[1]


def reference_dilated(start, end, base=2, skip=1):
    """`dilated_unmask_levels` over positions start..end (inclusive)."""
    if base == 1:
        return [list(range(start, end + 1))]
    stride = (end - start + 1) // (base ** skip)
    levels, revealed = [], set()
    while stride >= 1:
        this_round = [i for i in range(start, end + 1) if (i - start) % stride == 0 and i not in revealed]
        if this_round:
            levels.append(this_round)
            revealed.update(this_round)
        stride //= base
    remainder = [i for i in range(start, end + 1) if i not in revealed]
    return levels + [remainder] if remainder else levels


def reference_binary(start, end, level=0, out=None):
    """`binary_search_levels`: the midpoint at `level`, then each half one level deeper."""
    out = [] if out is None else out
    if start > end:
        return out
    if len(out) <= level:
        out.append([])
    mid = (start + end) // 2
    out[level].append(mid)
    reference_binary(start, mid - 1, level + 1, out)
    reference_binary(mid + 1, end, level + 1, out)
    return out


def reference_schedule(start, end, scheduler, base, skip):
    """The block's levels, then `merge_last_level`: a last level shorter than the one before joins it."""
    levels = reference_dilated(start, end, base, skip) if scheduler == "dilated" else reference_binary(start, end)
    if len(levels) >= 2 and len(levels[-1]) < len(levels[-2]):
        levels[-2].extend(levels[-1])
        levels.pop()
    return levels


def reference_generate(model, prompt, gen_length, block_length, scheduler="dilated", base=2, skip=1,
                       threshold=0.0, remasking="low_confidence"):
    """`generate_scheduled` at temperature 0, one prompt, no early stop: per block its schedule; per level one
    forward, the argmax written at the level's still-masked positions; then, unless it is the block's last level,
    the level's positions whose float64 probability (low_confidence) or entropy -sum p ln(p + 1e-10)
    (high_entropy) is below the threshold are masked again, never to be revisited. The one change: MASK's logit is
    -inf (the toolkit never proposes MASK, see `samplers.base`). Dream's logits come aligned, as their harness's
    `logits_shift_fix` aligns them."""
    mask_id, start = model.config.mask_id, len(prompt)
    x = torch.full((1, start + gen_length), mask_id)
    x[0, :start] = torch.tensor(prompt)
    forwards = 0
    for block in range(gen_length // block_length):
        block_start = start + block * block_length
        schedule = reference_schedule(block_start, block_start + block_length - 1, scheduler, base, skip)
        for step, positions in enumerate(schedule):
            if not (x == mask_id).any():
                break
            logits = model(x)
            logits[..., mask_id] = float("-inf")
            forwards += 1
            x0 = logits.argmax(-1)
            for pos in positions:
                if x[0, pos] == mask_id:
                    x[0, pos] = x0[0, pos]
            if step < len(schedule) - 1:
                p = torch.softmax(logits.double(), dim=-1)
                if remasking == "low_confidence":
                    score = p.gather(-1, x0[..., None])[..., 0]
                else:
                    score = -(p * torch.log(p + 1e-10)).sum(-1)
                for pos in positions:
                    if score[0, pos] < threshold:
                        x[0, pos] = mask_id
    return x[0, start:].tolist(), forwards


def ours(name, prompt, gen_length, block_length, **params):
    model, tok = loaded(name)
    out = dllm.generate(model, tok, [prompt], sampler="dus", gen_length=gen_length, block_length=block_length,
                        stop_early=False, chat=True, **params)
    return out.sequences[0, -gen_length:].tolist(), out.stats.nfe


def test_the_plans_equal_the_authors_levels():
    """Every block length up to 40 with bases 1-4 and skips 1-3, and binary search: each offset's level is the
    authors' (their absolute positions, any block start); the spec's examples."""
    for length in range(1, 41):
        for scheduler, base, skip in [("binary", 2, 1)] + [("dilated", a, s) for a in (1, 2, 3, 4) for s in (1, 2, 3)]:
            want = reference_schedule(7, 7 + length - 1, scheduler, base, skip)
            got = levels_of(length, scheduler, base, skip)
            assert [sorted(7 + i for i in range(length) if got[i] == k) for k in range(max(got) + 1)] == \
                [sorted(level) for level in want], (length, scheduler, base, skip)
    assert levels_of(8, "dilated", 2, 1) == (0, 2, 1, 2, 0, 2, 1, 2)  # {0, 4}, {2, 6}, {1, 3, 5, 7}
    assert levels_of(32, "dilated", 2, 1)[:17] == (0, 4, 3, 4, 2, 4, 3, 4, 1, 4, 3, 4, 2, 4, 3, 4, 0)
    assert levels_of(8, "binary", 2, 1) == (2, 1, 2, 0, 2, 1, 2, 2)  # 3; 1, 5; 0, 2, 4, 6 with 7 (merged)


CONFIGS = {  # the spec's (a)-(d), and high_entropy
    "a": (16, 8, {}),
    "b": (32, 32, {"skip": 2}),
    "c": (16, 8, {"scheduler": "binary"}),
    "d": (24, 12, {"threshold": 0.3}),
    "high_entropy": (16, 8, {"threshold": 0.3, "remasking": "high_entropy"}),
}


@pytest.mark.parametrize("name", TRAINED + RANDOM)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_equals_generate_scheduled(name, config):
    gen_length, block_length, params = CONFIGS[config]
    model, tok = loaded(name)
    masks_left, prompts = 0, PROMPTS if name in TRAINED else PROMPTS[:2]  # a random model answers all alike
    for prompt, ids in zip(prompts, encode_prompts(tok, prompts, chat=True)):
        want = reference_generate(model, ids, gen_length, block_length, **params)
        assert ours(name, prompt, gen_length, block_length, **params) == want
        levels = levels_of(block_length, params.get("scheduler", "dilated"), 2, params.get("skip", 1))
        assert want[1] == (max(levels) + 1) * gen_length // block_length  # a forward per level, whatever steps
        masks_left += want[0].count(model.config.mask_id)
    # positions given up stay masked: (d) where confidences are low, high_entropy where entropies are
    assert (masks_left > 0) == ((config, name in RANDOM) in (("d", True), ("high_entropy", False)))


GIVING_UP = {"sampler": "dus", "gen_length": 64, "block_length": 16, "threshold": 0.9999}  # a few a block


def test_an_answer_keeps_the_masks_given_up_and_its_text_leaves_them_out():
    """Token ids keep the mask id where the plan gave up (the canvas as the authors' code leaves it); texts leave
    it out, as their harness decodes without special tokens. A row finishes at a stop token with only given-up
    masks before it: stopping early changes no answer and saves forwards."""
    model, tok = loaded("tiny-llada")
    out = dllm.generate(model, tok, PROMPTS, **GIVING_UP, trace=True)
    mask = model.config.mask_id
    assert all(mask in ids for ids in out.token_ids)
    assert out.texts == [tok.decode([t for t in ids if t != mask]) for ids in out.token_ids]
    assert not any("mask" in text for text in out.texts)
    whole = dllm.generate(model, tok, PROMPTS, **GIVING_UP, stop_early=False)
    assert whole.token_ids == out.token_ids and out.stats.nfe < whole.stats.nfe
    assert out.stats.gen_tokens < sum(64 for _ in PROMPTS)  # given up: not committed, not counted
    given_up = [(b, p) for step in out.trace for b, row in enumerate(step["given_up"]) for p in row]
    committed = [(b, c["position"]) for step in out.trace for b, row in enumerate(step["commits"]) for c in row]
    assert given_up and not set(given_up) & set(committed)  # the trace names them; each position decided once
    assert all(out.sequences[b, p] == mask for b, p in given_up)


@pytest.mark.parametrize("cache", ["none", "prefix", "dual", "dkv", "dkv_greedy", "elastic"])
def test_every_cache_leaves_exactly_the_given_up_positions_masked(cache):
    """With positions given up, every cache runs (dkv_greedy computes the next level, known ahead) and the masks
    left in the answers are exactly the positions the trace says were given up, on LLaDA and Dream."""
    from dllm.engine import decode

    for preset in RANDOM:
        model = loaded(preset)[0]
        canvas, stats, trace = decode(model, [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]],
                                      samplers.SAMPLERS.create("dus", threshold=0.1), caches.CACHES.create(cache), 32,
                                      8, stop_early=False, trace=True)
        given_up = {(b, p) for step in trace for b, row in enumerate(step["given_up"]) for p in row}
        assert given_up and set(map(tuple, (canvas.tokens == model.config.mask_id).nonzero().tolist())) == given_up
        assert stats.nfe == 4 * 3 and stats.gen_tokens == 2 * 32 - len(given_up)  # 3 levels a block of 8


def test_logprobs_are_refused_where_positions_are_given_up():
    model, tok = loaded("tiny-llada")
    with pytest.raises(DllmError, match="sampler 'dus' leaves the positions it gives up masked, which have no "
                                        "log-probability; drop logprobs or its threshold"):
        dllm.generate(model, tok, PROMPTS, **GIVING_UP, logprobs=1)
    assert dllm.generate(model, tok, PROMPTS[:1], sampler="dus", logprobs=1).logprobs[0]  # threshold 0: none


def blocks_to_finish(batch, rows, answers, done, blocks):
    for i, row in list(rows.items()):
        if batch.done(row):
            answers[i], done[i] = batch.answer(row), blocks[i]
            batch.remove(row)
            del rows[i]


def test_rows_joining_between_blocks_keep_their_given_up_masks():
    """Rows with their own thresholds join a running batch between blocks (a new layout each time): each gives its
    answer alone and finishes after as many of its blocks as alone (a given-up mask is remembered across layouts:
    forgotten, it would hold the stop back); no layout shows a pending mask before the current block."""
    model, tok = loaded("tiny-llada")
    ids = encode_prompts(tok, PROMPTS, chat=True)
    settings = [samplers.SAMPLERS.create("dus", threshold=t) for t in (0.9999, 0.0, 0.99999, 0.9999)]
    want_answers, want_blocks = {}, {}
    for i, (prompt, sampler) in enumerate(zip(ids, settings)):
        batch = Batch(model, sampler, caches.CACHES.create("none"), 16, 16)
        rows, blocks = {i: batch.add(prompt, 64)}, {i: 0}
        while rows:
            batch.run_block()
            blocks[i] += 1
            blocks_to_finish(batch, rows, want_answers, want_blocks, blocks)
    batch = Batch(model, settings[0], caches.CACHES.create("none"), 16, 16)
    rows, answers, done, blocks, joins = {}, {}, {}, {i: 0 for i in range(4)}, [0, 1, 1, 2]
    for block in range(8):
        for i in range(4):
            if joins[i] == block:
                rows[i] = batch.add(ids[i], 64, sampler=settings[i])
        if rows:
            batch.run_block()
            canvas = batch.canvas
            assert not (canvas.pending()[:, :batch.start] & canvas.answer[:, :batch.start]).any()
        for i in rows:
            blocks[i] += 1
        blocks_to_finish(batch, rows, answers, done, blocks)
    assert answers == want_answers and done == want_blocks
    assert min(want_blocks.values()) < 4  # rows finish early with given-up masks before their stop


def test_served_requests_with_their_own_thresholds_equal_alone():
    """`dllm serve`'s engine: requests with other thresholds share a batch, each gets its answer alone (masks given
    up in its ids, not in its text); one asking for logprobs with a threshold is refused in one line."""
    pytest.importorskip("fastapi")
    from dllm.serve import Engine
    from dllm.serve.requests import RequestReader

    model, tok = loaded("tiny-llada")
    defaults = {"sampler": "dus", "cache": "none", "sampler_args": {}, "cache_args": {}, "gen_length": 64,
                "block_length": 16, "steps": None, "seed": 0}
    reader, engine = RequestReader(model, tok, "tiny-llada", defaults), Engine(model, tok, max_batch=8)
    cases = [(prompt, {"threshold": t}) for prompt, t in zip(PROMPTS, (0.9999, 0.0, 0.99999, 0.9999))]
    jobs = {prompt: reader.job({"messages": [{"role": "user", "content": prompt}], **settings}, chat=True)
            for prompt, settings in cases}
    for job in jobs.values():
        engine.add(job.message())
    engine._admit()
    assert len(engine.groups) == 1
    ids: dict[str, list[int]] = {job.id: [] for job in jobs.values()}
    while engine.groups:
        engine.step()
        for delta in engine.outputs:
            ids[delta.req_id][delta.start:] = delta.token_ids
        engine.outputs.clear()
    for prompt, settings in cases:
        want = dllm.generate(model, tok, prompt, sampler="dus", gen_length=64, block_length=16, **settings)
        assert ids[jobs[prompt].id] == want.token_ids[0]
    assert any(model.config.mask_id in answer for answer in ids.values())
    with pytest.raises(DllmError, match="leaves the positions it gives up masked"):
        reader.job({"messages": [{"role": "user", "content": "copy: abcd"}], "threshold": 0.5, "logprobs": True},
                   chat=True)
