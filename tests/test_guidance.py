"""LLaDA's generation options `cfg_scale`, `logits_eos_inf`, `confidence_eos_eot_inf` (issue #34) against a plain
transcription of ML-GSAI/LLaDA `generate.py`, with any sampler and the caches that keep them exact."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import random_model

import dllm
from dllm.cache import PrefixBlocks
from dllm.core.errors import DllmError
from dllm.engine.text import encode_prompts

PROMPTS = ["reverse: abc12", "sort: 42,07,19,03", "add: 0457+0168", "copy: k3x9a"]


@pytest.fixture(scope="module")
def tiny():
    return dllm.load("tiny-llada")


@pytest.fixture(scope="module")
def eos_heavy():
    """A random LLaDA whose stop tokens' head rows are scaled up: EOS and EoT are the proposal at many positions,
    so each option changes the answers."""
    model = random_model("llada-tiny", std=0.2)
    with torch.no_grad():
        model.lm_head.weight[list(model.config.stop_ids)] *= 4
    return model, dllm.load("random:llada-tiny")[1]


def reference_generate(model, prompts, steps, gen_length, block_length, cfg_scale=0.0, logits_eos_inf=False,
                       confidence_eos_eot_inf=False):
    """`generate.py`'s `generate` at temperature 0 with low_confidence remasking, step by step: the batch left-padded
    with its attention mask; with cfg the prompt (padding included) masked in a second copy of the batch and
    logits = un + (cfg + 1) (cond - un); logits_eos_inf sets EOS's logit to -inf; confidence_eos_eot_inf then,
    after the proposal, EoT's and (at temperature 0 the noisy logits are the logits) EOS's; confidence = softmax
    gathered at the proposal; the scheduled count of the most confident masked positions of the block. The one
    change: MASK's logit is -inf (the toolkit never proposes MASK, see `samplers.base`)."""
    cfg = model.config
    eos, eot = cfg.filler_id, next(i for i in cfg.stop_ids if i != cfg.filler_id)
    width = max(map(len, prompts))
    x = torch.full((len(prompts), width + gen_length), cfg.mask_id)
    attention = torch.zeros_like(x)
    for b, ids in enumerate(prompts):
        x[b, :width - len(ids)] = cfg.pad_id
        x[b, width - len(ids):width] = torch.tensor(ids)
        attention[b, width - len(ids):] = 1
    prompt_index = x != cfg.mask_id
    per_block = steps // (gen_length // block_length)
    for block in range(gen_length // block_length):
        start = width + block * block_length
        masks = (x[:, start:start + block_length] == cfg.mask_id).sum(1)
        schedule = [[int(n) // per_block + (i < int(n) % per_block) for i in range(per_block)] for n in masks]
        for i in range(per_block):
            mask_index = x == cfg.mask_id
            if cfg_scale > 0:
                un_x = x.clone()
                un_x[prompt_index] = cfg.mask_id
                cond, un = model(torch.cat([x, un_x]), torch.cat([attention, attention])).chunk(2)
                logits = un + (cfg_scale + 1) * (cond - un)
            else:
                logits = model(x, attention)
            logits[..., cfg.mask_id] = float("-inf")
            if logits_eos_inf:
                logits[..., eos] = float("-inf")
            noisy = logits  # temperature 0: add_gumbel_noise returns its input
            x0 = noisy.argmax(-1)
            if confidence_eos_eot_inf:
                noisy[..., eos] = float("-inf")
                logits[..., eot] = float("-inf")
            p = F.softmax(logits, dim=-1)
            x0_p = p.gather(-1, x0[..., None])[..., 0]
            x0_p[:, start + block_length:] = float("-inf")
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, float("-inf"))
            for j in range(len(prompts)):
                chosen = (-confidence[j]).sort(stable=True).indices[:schedule[j][i]]  # torch.topk; ties: lowest
                x[j, chosen] = x0[j, chosen]
    return [row[width:].tolist() for row in x]


@pytest.mark.parametrize("options", [dict(cfg_scale=1.5), dict(logits_eos_inf=True), dict(confidence_eos_eot_inf=True),
                                     dict(cfg_scale=0.5, confidence_eos_eot_inf=True, logits_eos_inf=True)])
@pytest.mark.parametrize("gen_length,block_length,steps", [(32, 32, 32), (32, 8, 16)])
def test_options_are_token_identical_to_llada_generate(eos_heavy, options, gen_length, block_length, steps):
    model, tok = eos_heavy
    ids = encode_prompts(tok, PROMPTS, chat=True)
    want = reference_generate(model, ids, steps, gen_length, block_length, **options)
    out = dllm.generate(model, tok, PROMPTS, gen_length=gen_length, block_length=block_length, steps=steps,
                        stop_early=False, **options)
    start = out.sequences.shape[1] - gen_length
    assert out.sequences[:, start:].tolist() == want
    plain = reference_generate(model, ids, steps, gen_length, block_length)
    assert want != plain  # each option changes what the model answers here


@pytest.mark.parametrize("sampler,cache,args", [
    ("low_confidence", "prefix", dict(refresh_every=1)),  # refreshed every step: exactly no cache
    ("low_confidence", "dual", dict(refresh_every=1)),
    ("low_confidence", "dkv", dict(refresh_every=1)),
    ("low_confidence", "dllm_cache", dict(prompt_interval=1, response_interval=1)),
    ("speculative", "dual", {}),  # lossless: its drafts verified with guidance too
])
def test_guided_caches_keep_the_unconditional_rows_keys_and_values_apart(tiny, sampler, cache, args):
    """The unconditional copies have their own rows in the store: a cache refreshed every step decodes exactly
    what no cache does, and the lossless speculative sampler over dual what stepwise decoding over dual does."""
    model, tok = tiny
    plain = dllm.generate(model, tok, PROMPTS, gen_length=32, block_length=8, cfg_scale=1.0,
                          cache=cache if sampler == "speculative" else None)
    out = dllm.generate(model, tok, PROMPTS, sampler=sampler, cache=cache, gen_length=32, block_length=8,
                        cfg_scale=1.0, cache_args=args)
    assert out.token_ids == plain.token_ids
    if sampler == "speculative":
        assert out.stats.nfe < plain.stats.nfe


def test_a_guided_padded_row_is_the_prompt_alone_and_the_doubled_batch_is_counted(tiny):
    model, tok = tiny
    batch = dllm.generate(model, tok, PROMPTS, gen_length=32, block_length=8, cfg_scale=1.0, cache="dual")
    alone = [dllm.generate(model, tok, [p], gen_length=32, block_length=8, cfg_scale=1.0, cache="dual").token_ids[0]
             for p in PROMPTS]
    assert batch.token_ids == alone
    plain = dllm.generate(model, tok, PROMPTS[:1], gen_length=32, block_length=32, stop_early=False)
    guided = dllm.generate(model, tok, PROMPTS[:1], gen_length=32, block_length=32, stop_early=False, cfg_scale=1.0)
    assert guided.stats.nfe == plain.stats.nfe  # one forward per step, of twice the rows
    assert guided.stats.rows_per_layer == [2 * n for n in plain.stats.rows_per_layer]


def test_what_cannot_keep_the_options_is_refused(tiny):
    model, tok = tiny
    with pytest.raises(DllmError, match="cache 'elastic' refreshes every row of a batch where any row drifts"):
        dllm.generate(model, tok, PROMPTS, cache="elastic", cfg_scale=1.0)
    with pytest.raises(DllmError, match="sampler 'entropy' orders by its own score; use one of low_confidence"):
        dllm.generate(model, tok, PROMPTS, sampler="entropy", confidence_eos_eot_inf=True)
    with pytest.raises(DllmError, match="cfg_scale must be a number >= 0"):
        dllm.generate(model, tok, PROMPTS, cfg_scale=-1)
    with pytest.raises(DllmError, match="logits_eos_inf must be True or False"):
        dllm.generate(model, tok, PROMPTS, logits_eos_inf="yes")
    sdar, sdar_tok = dllm.load("random:sdar-tiny")  # a block-causal model: a prefix cache applies
    with pytest.raises(DllmError, match="a prefix cache keeps the keys and values of guided rows only"):
        dllm.generate(sdar, sdar_tok, PROMPTS, cfg_scale=1.0, prefix_cache=PrefixBlocks(sdar, 8))
    gemma, gemma_tok = dllm.load("random:diffusion-gemma-tiny")  # uniform-state: no mask for the prompt
    with pytest.raises(DllmError, match="this is a uniform-state model .no mask token.; use cfg_scale=0"):
        dllm.generate(gemma, gemma_tok, PROMPTS, cfg_scale=1.0)


def test_confidence_eos_eot_inf_leaves_eos_scored_at_a_temperature(tiny):
    """The reference's chained assignment writes EOS's -inf into the noisy logits, which at temperature > 0 are a
    separate tensor no longer read: only EoT's probability is left out there."""
    from dllm.engine.guidance import Guidance
    cfg = tiny[0].config
    eot = [i for i in cfg.stop_ids if i != cfg.filler_id]
    assert Guidance(confidence_eos_eot_inf=True).unscored(cfg, 0.0, "cpu").tolist() == [cfg.filler_id, *eot]
    assert Guidance(confidence_eos_eot_inf=True).unscored(cfg, 0.7, "cpu").tolist() == eot
    assert Guidance().unscored(cfg, 0.0, "cpu") is None


def test_confidence_eos_eot_inf_reaches_the_sampler_in_its_step_context(eos_heavy, monkeypatch):
    """The option is a field of the step's `StepContext` (`unscored`), not state around the step: each step's
    commit, recomputed from its context alone after decoding, is the one the loop took, and the option changed
    some of them (without the field they would be the plain rule's)."""
    from dllm.samplers.llada import LowConfidence

    model, tok = eos_heavy
    steps, choose = [], LowConfidence.choose
    monkeypatch.setattr(LowConfidence, "choose", lambda self, ctx: steps.append((self, ctx, choose(self, ctx))) or
                        steps[-1][2])
    dllm.generate(model, tok, PROMPTS, gen_length=32, block_length=8, steps=16, stop_early=False,
                  confidence_eos_eot_inf=True)
    assert steps and all(ctx.unscored is not None for _, ctx, _ in steps)
    plain = 0
    for sampler, ctx, commit in steps:
        again = choose(sampler, ctx)
        assert torch.equal(again.mask, commit.mask) and torch.equal(again.tokens, commit.tokens)
        plain += not torch.equal(choose(sampler, dataclasses.replace(ctx, unscored=None)).mask, commit.mask)
    assert plain > 0


@pytest.mark.parametrize("gen_length,block_length,steps", [(64, 64, 64), (64, 8, 64), (64, 32, 32)])
def test_a_sharp_model_decodes_as_llada_generate(gen_length, block_length, steps):
    """random:llada-tiny with its head scaled by 30 (near-tied, saturating confidences), ten prompts: every answer
    is the reference's (with exp(logit - logsumexp) as the confidence 0, 3 and 0 of 10 were)."""
    model, tok = random_model("llada-tiny", std=0.2), dllm.load("random:llada-tiny")[1]
    with torch.no_grad():
        model.lm_head.weight *= 30
    prompts = [f"copy: {w}" for w in ("abc", "k3x9a", "hello", "zz", "q1w2e3", "xyz", "m", "12345", "abcdef", "ok")]
    ids = encode_prompts(tok, prompts, chat=True)
    want = reference_generate(model, ids, steps, gen_length, block_length)
    out = dllm.generate(model, tok, prompts, gen_length=gen_length, block_length=block_length, steps=steps,
                        stop_early=False)
    assert out.sequences[:, -gen_length:].tolist() == want


def test_rows_with_their_own_temperatures_keep_the_options_each_as_alone(eos_heavy):
    """A batch whose rows have their own temperatures (`Batch.add(..., sampler=...)`, the server's batch per kind of
    request) under cfg_scale and confidence_eos_eot_inf: each row leaves out EOS by its own temperature (at 0 EOS
    and EoT, above 0 EoT only) and decodes as alone."""
    from dllm import cache as caches
    from dllm import samplers
    from dllm.engine import Batch
    from dllm.engine.options import LoopOptions
    from dllm.engine.guidance import Guidance

    model, tok = eos_heavy
    guidance = Guidance(cfg_scale=1.0, confidence_eos_eot_inf=True)
    greedy, warm = (samplers.SAMPLERS.create("low_confidence", temperature=t) for t in (0.0, 0.7))
    ids = encode_prompts(tok, PROMPTS, chat=True)
    rows = [(ids[0], 0, greedy), (ids[1], 1, warm), (ids[0], 0, warm), (ids[2], 2, greedy)]

    def decode(rows):
        batch = Batch(model, rows[0][2], caches.CACHES.create("none"), 8, 4,
                      LoopOptions(stop_early=False, guidance=guidance))
        added = [batch.add(prompt, 16, seed, sampler) for prompt, seed, sampler in rows]
        while batch.running:
            batch.run_block()
        batch.save()
        return [row.tokens[len(row.prompt):].tolist() for row in added]  # stop tokens too: this model proposes them

    alone = [decode([row])[0] for row in rows]
    assert decode(rows) == alone
    assert alone[0] != alone[2]
    mask = guidance.unscored(model.config, torch.tensor([0.0, 0.7], dtype=torch.float64), "cpu")
    eot = [i for i in model.config.stop_ids if i != model.config.filler_id]
    assert mask.nonzero().tolist() == sorted([[0, model.config.filler_id], *([r, i] for r in (0, 1) for i in eot)])
