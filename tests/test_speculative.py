"""Self-speculative decoding (spec adablock_selfspec.md B7): the stepwise output token for token, with fewer
forwards; the oracle forward count; the cases it refuses."""
import math

import pytest
import torch
from conftest import random_model

from dllm import cache as caches
from dllm import samplers
from dllm.core.errors import DllmError
from dllm.engine import decode
from dllm.engine.guidance import Guidance

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]


def run(model, sampler, cache="none", prompts=PROMPTS, **params):
    return decode(model, prompts, samplers.SAMPLERS.create(sampler, **params), caches.CACHES.create(cache), 32, 8,
                  stop_early=False)


@pytest.fixture(scope="module", params=["llada-tiny", "dream-tiny"])
def model(request):
    return random_model(request.param)


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_speculative_is_stepwise_with_fewer_forwards(model, cache):
    want, stepwise, _ = run(model, "low_confidence", cache)
    got, stats, _ = run(model, "speculative", cache, draft_steps=4)
    assert torch.equal(got.tokens, want.tokens)
    assert stats.nfe < stepwise.nfe == 32
    assert stats.gen_tokens == stepwise.gen_tokens


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_a_block_whose_rows_start_at_column_zero_verifies(model, cache):
    """A one-token prompt on Dream (its block is scored from column 0) makes prefix compute the whole canvas at
    every step, which is not a refresh: speculative still gives the stepwise output."""
    want, stepwise, _ = run(model, "low_confidence", cache, prompts=[[5]])
    got, stats, _ = run(model, "speculative", cache, prompts=[[5]])
    assert torch.equal(got.tokens, want.tokens) and stats.nfe < stepwise.nfe


def test_draft_steps_default_to_freedaves_per_model_family(model):
    """K = 4 on LLaDA, 8 on Dream (FreeDave's settings): the default decodes as that K, not as the other."""
    k, other = (8, 4) if model.config.logit_shift else (4, 8)
    _, default, _ = run(model, "speculative", "dual")
    _, want, _ = run(model, "speculative", "dual", draft_steps=k)
    _, not_want, _ = run(model, "speculative", "dual", draft_steps=other)
    assert (default.nfe, default.rows_per_layer) == (want.nfe, want.rows_per_layer)
    assert default.rows_per_layer != not_want.rows_per_layer


def test_one_draft_is_stepwise_forward_for_forward(model):
    want, stepwise, _ = run(model, "low_confidence", "dual")
    got, stats, _ = run(model, "speculative", "dual", draft_steps=1)
    assert torch.equal(got.tokens, want.tokens) and stats.nfe == stepwise.nfe
    assert stats.rows_per_layer == stepwise.rows_per_layer


@pytest.mark.parametrize("params", [{}, {"force_first": True, "threshold": 0.2}])
def test_padded_rows_match_their_prompts_alone(model, params):
    batch, _, _ = run(model, "speculative", "dual", **params)
    for row, prompt in enumerate(PROMPTS):
        alone, _, _ = run(model, "speculative", "dual", prompts=[prompt], **params)
        assert torch.equal(batch.tokens[row, batch.prompt_length:], alone.tokens[0, alone.prompt_length:])


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_context_free_predictions_accept_every_draft(k):
    """Oracle (B7.4): with attention outputs zeroed, predictions never depend on the context, so each round
    accepts all its drafts: 1 + ceil((B - 1) / K) forwards per block of B."""
    model = random_model("llada-tiny")
    for layer in model.layers:
        layer.o_proj.weight.data.zero_()
    got, stats, _ = run(model, "speculative", "dual", prompts=PROMPTS[:1], draft_steps=k)
    want, _, _ = run(model, "low_confidence", "dual", prompts=PROMPTS[:1])
    assert torch.equal(got.tokens, want.tokens)
    assert stats.nfe == 4 * (1 + math.ceil(7 / k))


def test_refusals(model):
    with pytest.raises(DllmError, match="greedy decoding only; set temperature=0"):
        samplers.SAMPLERS.create("speculative", temperature=0.5)
    with pytest.raises(DllmError, match="use cache 'dual' with refresh_every=0"):  # checked before any forward
        decode(model, PROMPTS, samplers.SAMPLERS.create("speculative"), caches.CACHES.create("dual", refresh_every=2),
               32, 8)

    @caches.register("stateful_test")
    class Stateful(caches.CACHES.get("dual")):
        verifies_drafts = False

    try:
        with pytest.raises(DllmError, match=r"cannot do without changing its state; use cache none, prefix, dual "
                                            r"or \(block-causal models\) block"):
            run(model, "speculative", "stateful_test")
    finally:
        caches.CACHES.classes.pop("stateful_test")


@pytest.mark.parametrize("preset", ["sdar-tiny", "fast-dllm-v2-tiny", "llada2-tiny"])
def test_block_cache_verifies_drafts_on_block_causal_models(preset):
    """The exact block cache keeps nothing but its store past a block's first step, so drafts verify on a fork
    of it: the stepwise output of the block-causal model (aligned and shifted logits, MoE) with fewer forwards."""
    model = random_model(preset)
    block = model.config.block_size

    def run_block_cache(sampler, **params):
        return decode(model, PROMPTS, samplers.SAMPLERS.create(sampler, **params), caches.CACHES.create("block"),
                      8 * block, block, stop_early=False)

    want, stepwise, _ = run_block_cache("low_confidence")
    got, stats, _ = run_block_cache("speculative", draft_steps=4)
    assert torch.equal(got.tokens, want.tokens)
    assert stats.nfe < stepwise.nfe


def same_run(a, b):
    (tokens, stats, _), (other, other_stats, _) = a, b
    return torch.equal(tokens.tokens, other.tokens) and (stats.nfe, stats.rows_per_layer, stats.gen_tokens) == \
        (other_stats.nfe, other_stats.rows_per_layer, other_stats.gen_tokens)


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_tree_attention_verifies_as_batch_expansion(model, cache):
    """FreeDave's tree attention (the drafts as extra rows of one forward, each seeing the store's other columns and
    itself) gives batch expansion's tokens, forwards and rows computed: padded rows, Dream's shifted rows."""
    for k in (2, 4):
        assert same_run(run(model, "speculative", cache, draft_steps=k, verify="tree"),
                        run(model, "speculative", cache, draft_steps=k, verify="batch"))


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_tree_attention_under_guidance(cache):
    """The drafts' unconditional copies (the prompt masked in the rows of each draft that hold it)."""
    model = random_model("llada-tiny")

    def guided(verify):
        return decode(model, PROMPTS, samplers.SAMPLERS.create("speculative", verify=verify),
                      caches.CACHES.create(cache), 32, 8, stop_early=False, guidance=Guidance(cfg_scale=1.0))
    assert same_run(guided("tree"), guided("batch"))


@pytest.mark.parametrize("preset", ["fast-dllm-v2-tiny", "llada2-tiny"])
def test_tree_attention_on_block_causal_models(preset):
    model = random_model(preset)
    block = model.config.block_size

    def verified(how):
        return decode(model, PROMPTS, samplers.SAMPLERS.create("speculative", draft_steps=4, verify=how),
                      caches.CACHES.create("block"), 8 * block, block, stop_early=False)
    assert same_run(verified("tree"), verified("batch"))
