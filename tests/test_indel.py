"""LLaDA2.2's insert/delete decoding (`joint_threshold_indel`) against a plain per-row transcription of SGLang's
`JointThresholdInDel.step` (spec new_families.md section 2), then through the decode loop on random:llada2.2-tiny."""
import random
from types import SimpleNamespace

import pytest
import torch

import dllm
from dllm import samplers
from dllm.core.errors import DllmError
from dllm.engine import decode
from dllm.engine.options import split_params
from dllm.samplers import StepContext
from dllm.samplers.base import token_probability
from dllm.samplers.indel import relay

C, V = 8, 12  # block width, vocabulary
MASK, DELETE, SPLIT = 11, 9, 10
MAX_POST = 3


def reference_step(row: dict, tokens: list[int], logits: torch.Tensor, threshold=0.5, edit_threshold=0.0):
    """One step of one row, as the reference: greedy argmax and its softmax probability; M2T (above the threshold,
    else the 1 + new-mask most confident, all masks once no original one is left or at cleanup); T2T; the cleanup
    scrub; the anti-loop rule; DELETE/SPLIT re-lay. Returns the new block (None: the row's block has ended)."""
    probs = logits.double().softmax(-1)
    x = logits.argmax(-1).tolist()
    p = [probs[i, x[i]].item() for i in range(C)]
    masks = [t == MASK for t in tokens]
    original = [o and m for o, m in zip(row["original"], masks)]
    n_orig, n_mask = sum(original), sum(masks)
    row["updates"] += 1
    row["post"] += n_orig == 0
    cleanup = row["post"] > MAX_POST or row["updates"] > C + MAX_POST
    answer = [i >= row["prompt"] for i in range(C)]
    m2t = set()
    if n_mask:
        if cleanup or n_orig == 0:
            m2t = {i for i in range(C) if masks[i]}
        else:
            need = 1 + n_mask - n_orig
            high = {i for i in range(C) if masks[i] and p[i] > threshold}
            m2t = high if len(high) >= need else set(sorted((i for i in range(C) if masks[i]),
                                                           key=lambda i: (-p[i], i))[:min(need, n_mask)])
    t2t = {i for i in range(C) if answer[i] and not masks[i] and p[i] > edit_threshold and tokens[i] != x[i]}
    write = sorted(m2t | t2t)
    if not write:
        return None
    if cleanup:
        for i in write:
            if x[i] in (MASK, DELETE, SPLIT):
                scores = logits[i].clone()
                scores[[MASK, DELETE, SPLIT]] = -float("inf")
                x[i] = int(scores.argmax())
    key = tuple(tokens)
    if key in row["seen"] and not cleanup:
        changing = [i for i in write if x[i] != tokens[i]]
        if changing:
            i = min(changing, key=lambda i: (p[i], i))
            scores = logits[i].clone()
            for t in row["tried"].get(i, ()):
                scores[t] = -float("inf")
            if original[i]:
                scores[MASK] = -float("inf")
            x[i] = int(scores.argmax())
    row["seen"].add(key)
    block = list(tokens)
    for i in write:
        row["tried"].setdefault(i, set()).add(x[i])
        block[i] = x[i]
    if any(block[i] in (DELETE, SPLIT) for i in write):
        out, flags = tokens[:row["prompt"]], row["original"][:row["prompt"]]
        for i in range(row["prompt"], C):
            if block[i] == SPLIT:
                out, flags = out + [MASK, tokens[i]], flags + [False, row["original"][i]]
            elif block[i] != DELETE:
                out, flags = out + [block[i]], flags + [row["original"][i]]
        block = (out + [MASK] * C)[:C]
        row["original"] = (flags + [False] * C)[:C]
    if cleanup:
        row["ended"] = True
    return block


def random_logits(g: torch.Generator, rows: int) -> torch.Tensor:
    """Peaked logits whose argmax is often DELETE or SPLIT, drawn from a few patterns so that block states repeat
    (the anti-loop rule) and probabilities sit on both sides of the thresholds; MASK is -inf, as the loop sets it."""
    patterns = torch.randn(4, C, V, generator=g) * 3
    pick = torch.randint(0, 4, (rows,), generator=g)
    logits = patterns[pick] + 0.3 * torch.randn(rows, C, V, generator=g)
    logits[..., [DELETE, SPLIT]] += torch.rand(rows, C, 2, generator=g) * 3
    logits[..., MASK] = -float("inf")
    return logits


def run_both(seed: int, rows: int = 16):
    """Drive the sampler (as the loop drives it) and the reference on the same logits; the block states and the
    steps at which each row's block ends, of both."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    prompts = [rng.randint(0, 3) for _ in range(rows)]
    canvas = torch.tensor([[rng.randint(0, 8) for _ in range(p)] + [MASK] * (C - p) for p in prompts])
    answer = torch.arange(C)[None] >= torch.tensor(prompts)[:, None]
    refs = [dict(prompt=p, original=[i >= p for i in range(C)], updates=0, post=0, seen=set(), tried={}, ended=False)
            for p in prompts]
    ref_blocks, ref_end = [canvas[b].tolist() for b in range(rows)], [None] * rows
    sampler = samplers.SAMPLERS.create("joint_threshold_indel", max_post_edit_steps=MAX_POST)
    config = SimpleNamespace(mask_id=MASK, edit_ids=(DELETE, SPLIT))
    state, open_rows, ours_end, history = SimpleNamespace(), torch.ones(rows, dtype=torch.bool), [None] * rows, []
    for step in range(3 * C + 2 * MAX_POST):
        logits = random_logits(g, rows)
        masked = canvas == MASK
        ctx = StepContext(logits, masked & answer, masked, torch.arange(C), canvas.clone(), step, C, 0,
                          [None] * rows, step, C, 0, C, 0, state, editable=~masked & answer, config=config)
        out = sampler.step(ctx)
        written = (out.mask & masked) | (out.edit & ctx.editable)
        canvas = torch.where(written, out.tokens, canvas)  # the loop's write
        now_open = (canvas == MASK).any(1) | out.again
        for b in range(rows):
            if open_rows[b] and not now_open[b]:
                ours_end[b] = step
            if ref_end[b] is None:
                new = None if refs[b]["ended"] else reference_step(refs[b], ref_blocks[b], logits[b])
                if new is None or refs[b]["ended"]:
                    ref_end[b] = step
                ref_blocks[b] = new or ref_blocks[b]
        open_rows = now_open
        history.append((canvas.tolist(), [list(r) for r in ref_blocks]))
    return history, ours_end, ref_end


@pytest.mark.parametrize("seed", range(6))
def test_each_step_equals_the_reference_rule(seed):
    history, ours_end, ref_end = run_both(seed)
    for step, (ours, ref) in enumerate(history):
        assert ours == ref, f"step {step}"
    assert ours_end == ref_end


def test_the_rules_fire():
    """The random steps exercise every rule: edits that re-lay blocks, cleanups, the anti-loop rule."""
    g = torch.Generator().manual_seed(0)
    seen = {"relay": 0, "cleanup": 0, "loop": 0}
    for seed in range(6):
        rng = random.Random(seed)
        rows = [dict(prompt=rng.randint(0, 3), updates=0, post=0, seen=set(), tried={}, ended=False)
                for _ in range(16)]
        for r in rows:
            r["original"] = [i >= r["prompt"] for i in range(C)]
            r["block"] = [1] * r["prompt"] + [MASK] * (C - r["prompt"])
        for _ in range(3 * C + 2 * MAX_POST):
            logits = random_logits(g, len(rows))
            for b, r in enumerate(rows):
                if r["ended"]:
                    continue
                repeated, before = tuple(r["block"]) in r["seen"], list(r["original"])
                new = reference_step(r, r["block"], logits[b])
                if new is None:
                    r["ended"] = True
                    continue
                seen["loop"] += repeated
                seen["cleanup"] += r["ended"]
                seen["relay"] += r["original"] != before
                r["block"] = new
    assert all(count > 0 for count in seen.values()), seen


def test_relay_moves_tokens_and_original_marks():
    """DELETE closes up (a new mask at the end), SPLIT opens a mask before the old token (the last one falls off);
    the prompt part never moves."""
    new = torch.tensor([5, 6, DELETE, 7, SPLIT, 8])
    old = torch.tensor([5, 6, 1, MASK, 2, MASK])
    original = torch.tensor([False, False, True, True, False, True])
    tokens, flags = relay(new, old, original, 2, MASK, DELETE, SPLIT)
    assert tokens.tolist() == [5, 6, 7, MASK, 2, 8]
    assert flags.tolist() == [False, False, True, False, False, True]
    tokens, flags = relay(torch.tensor([SPLIT, 3, 4]), torch.tensor([9, MASK, MASK]), torch.tensor([True] * 3), 0,
                          MASK, DELETE, SPLIT)
    assert tokens.tolist() == [MASK, 9, 3] and flags.tolist() == [False, True, True]


@pytest.fixture(scope="module")
def editing_model():
    """random:llada2.2-tiny with its head leaning towards DELETE and SPLIT, so that blocks are re-laid."""
    model, tok = dllm.load("random:llada2.2-tiny")
    with torch.no_grad():
        delete, split = model.config.edit_ids
        model.lm_head.weight[[delete, split]] *= 40
    return model, tok


def generate(model, prompts, cache="block") -> list[list[int]]:
    """Each row's answer tokens (the whole canvas after its prompt)."""
    sampler, cache = split_params("joint_threshold_indel", cache, {})
    canvas, _, _ = decode(model, prompts, sampler, cache, 32, 8)
    return [canvas.tokens[b, a:e].tolist() for b, (a, e) in enumerate(zip(canvas.gen_start, canvas.gen_end))]


def test_a_padded_row_decodes_as_alone_and_the_block_cache_stays_exact(editing_model, monkeypatch):
    from dllm.samplers import indel

    model, _ = editing_model
    relays = []
    monkeypatch.setattr(indel, "relay", lambda *args: relays.append(1) or relay(*args))
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]
    together = generate(model, prompts)
    assert len(relays) > 3  # blocks were re-laid
    assert together == [generate(model, [prompt])[0] for prompt in prompts]
    assert generate(model, prompts, cache="none") == together


def test_a_model_without_edit_tokens_is_refused():
    model, _ = dllm.load("random:llada2-tiny")
    with pytest.raises(DllmError, match="sampler 'joint_threshold_indel' cannot decode llada2: it writes the delete "
                                        "and split tokens .* use joint_threshold"):
        generate(model, [[5, 6]])


def test_the_confidence_is_the_argmax_probability():
    """The reference scores a position by the softmax probability of its argmax, which `token_probability` is."""
    logits = torch.randn(3, C, V)
    assert torch.allclose(token_probability(logits, logits.argmax(-1)), logits.softmax(-1).amax(-1), atol=1e-6)


def test_the_edit_tokens_load_from_config_json(tmp_path):
    """A LLaDA2.2 checkpoint names its edit tokens in config.json (`delete_token_id`, `split_token_id`)."""
    model, tok = dllm.load("random:llada2.2-tiny")
    dllm.save_pretrained(model, tok, tmp_path)
    loaded, _ = dllm.load(str(tmp_path))
    assert loaded.config.edit_ids == (123, 124) and generate(loaded, [[5, 6]]) == generate(model, [[5, 6]])
