"""Continuous batching in the engine (`Batch`): rows that join and leave between blocks give the tokens they give
alone, for every block-local sampler over every cache that recomputes all rows at a block start."""
import pytest
import torch
from conftest import PC_TABLE, random_model

from dllm import cache as caches
from dllm import samplers
from dllm.core.errors import DllmError
from dllm.engine import Batch, decode

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19], [20, 21]]
GEN = [32, 16, 24, 16]  # answer lengths, in blocks of 8
JOINS = [0, 1, 1, 3]  # the block (of the batch) before which each prompt joins
BLOCK = 8
SAMPLER_ARGS = {"threshold": {"threshold": 0.5}, "credit": {"threshold": 0.5}, "localleap": {"threshold": 0.5},
                "speculative": {"draft_steps": 2}, "pc_sampler": PC_TABLE}
BLOCK_LOCAL = [cls.name for cls in samplers.SAMPLERS if cls.block_local]


@pytest.fixture(scope="module", params=["llada-tiny", "dream-tiny"])
def model(request):
    return random_model(request.param)


def alone(model, sampler, cache, prompt, gen, seed):
    canvas, _, _ = decode(model, [prompt], sampler, cache, gen, BLOCK, seed=seed)
    answer = canvas.tokens[0, canvas.prompt_length:].tolist()
    stops = model.config.stop_ids
    return answer[:next((i for i, t in enumerate(answer) if t in stops), len(answer))]


def staggered(model, sampler, cache, max_batch=3):
    """Rows join at JOINS (waiting while the batch is full) and leave once done; returns each row's answer and
    the largest batch run."""
    batch = Batch(model, sampler, cache, BLOCK, BLOCK)
    waiting, running, answers, widest = list(range(len(PROMPTS))), {}, {}, 0
    block = 0
    while waiting or running:
        for i, row in list(running.items()):
            if batch.done(row):
                answers[i] = batch.answer(row)
                batch.remove(row)
                del running[i]
        for i in list(waiting):
            if JOINS[i] <= block and len(running) < max_batch:
                running[i] = batch.add(PROMPTS[i], GEN[i], seed=i)
                waiting.remove(i)
        if running:
            widest = max(widest, len(running))
            batch.run_block()
        block += 1
    return [answers[i] for i in range(len(PROMPTS))], widest


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("sampler", BLOCK_LOCAL)
def test_rows_joining_between_blocks_equal_alone(model, sampler, cache):
    if sampler == "speculative" and cache != "none" or sampler in ("maskgit_plus", "entropy", "topk_margin",
                                                                     "origin") and model.config.arch == "llada":
        pytest.skip("covered by the other model / cache")
    if samplers.SAMPLERS.create(sampler).check_model(model.config):
        pytest.skip("refused on this model in one line (tests/test_research_samplers.py)")
    args = SAMPLER_ARGS.get(sampler, {})
    temperature = {"temperature": 0.7} if sampler in ("low_confidence", "maskgit_plus", "origin") else {}
    s = samplers.SAMPLERS.create(sampler, **args, **temperature)
    got, widest = staggered(model, s, caches.CACHES.create(cache))
    want = [alone(model, s, caches.CACHES.create(cache), p, g, seed=i) for i, (p, g) in enumerate(zip(PROMPTS, GEN))]
    assert widest >= 2  # rows really shared blocks
    assert got == want


def test_a_sampled_row_is_the_same_in_any_batch(model):
    """Each row draws from its own generator: with temperature, a prompt's tokens do not depend on its
    neighbours (two copies of one prompt in a batch agree)."""
    s = samplers.SAMPLERS.create("low_confidence", temperature=1.0)
    canvas, _, _ = decode(model, [PROMPTS[0], PROMPTS[1], PROMPTS[0]], s, caches.CACHES.create("none"), 16, BLOCK,
                          seed=3)
    lone, _, _ = decode(model, [PROMPTS[0]], s, caches.CACHES.create("none"), 16, BLOCK, seed=3)
    assert torch.equal(canvas.tokens[0], canvas.tokens[2])
    assert torch.equal(canvas.tokens[0, canvas.prompt_length:], lone.tokens[0, lone.prompt_length:])


def test_a_list_of_seeds_samples_one_prompt_several_times_in_one_batch():
    """seed=[3, 4, 5]: row i draws as the prompt alone with seed i (best-of-n in one batch)."""
    import dllm
    model, tok = dllm.load("tiny-llada")
    args = dict(temperature=5.0, gen_length=16, block_length=16)
    batch = dllm.generate(model, tok, ["copy: k3x9a"] * 3, seed=[3, 4, 5], **args).texts
    assert batch == [dllm.generate(model, tok, "copy: k3x9a", seed=s, **args).texts[0] for s in (3, 4, 5)]
    assert len(set(batch)) > 1
    with pytest.raises(dllm.DllmError, match="seed is a list of 2 seeds for 3 prompts"):
        dllm.generate(model, tok, ["copy: k3x9a"] * 3, seed=[3, 4], **args)


@pytest.mark.parametrize("sampler,cache", [("prophet", "none"), ("adablock", "dual"), ("low_confidence", "dkv"),
                                           ("threshold", "elastic")])
def test_whole_answer_methods_refuse_rows_mid_run(sampler, cache):
    model = random_model("llada-tiny")
    s = samplers.SAMPLERS.create(sampler, **({"delimiter_ids": "7"} if sampler == "adablock" else {}))
    batch = Batch(model, s, caches.CACHES.create(cache), BLOCK, BLOCK)
    batch.add(PROMPTS[0], 16)
    batch.add(PROMPTS[1], 16)
    assert not batch.joins_between_blocks
    batch.run_block()
    with pytest.raises(DllmError, match="cannot take rows into a running batch"):
        batch.add(PROMPTS[2], 16)
    with pytest.raises(DllmError, match="cannot drop rows from a running batch; let it finish"):
        batch.remove(batch.rows[0])


def test_a_row_of_part_of_a_block_is_refused_naming_a_length_that_fits():
    batch = Batch(random_model("llada-tiny"), samplers.SAMPLERS.create("low_confidence"), caches.CACHES.create("none"),
                  BLOCK, BLOCK)
    with pytest.raises(DllmError, match=r"gen_length \(12\) must be a multiple of block_length \(8\); e.g. "
                                        r"gen_length 16$"):
        batch.add(PROMPTS[0], 12)


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_a_row_with_nothing_left_to_decode_is_left_out_of_the_forward(cache):
    """A row that has finished, or has decoded its block while others have not, is not computed: the batch computes
    each row's canvas in exactly the forwards the row runs alone (with the no-cache canvas, every position of the
    batch's width), and each row gives its tokens alone."""
    import dllm
    model, tok = dllm.load("tiny-llada")
    prompts = ["copy: ab", "add: 0062+8111"]  # one block; two
    args = dict(sampler="threshold", cache=cache, gen_length=64, block_length=32)
    batch = dllm.generate(model, tok, prompts, **args)
    alone = [dllm.generate(model, tok, p, **args) for p in prompts]
    assert batch.texts == [a.texts[0] for a in alone]
    assert batch.stats.nfe < sum(a.stats.nfe for a in alone)  # the rows shared forwards
    if cache == "none":
        assert batch.stats.rows_per_layer[0] == batch.sequences.shape[1] * sum(a.stats.nfe for a in alone)


def test_a_finished_row_of_a_uniform_state_model_is_left_out_of_the_forward():
    """DiffusionGemma (no mask, self-conditioning inputs per row): a row whose answer ends a block earlier is not
    computed in the next block's forwards, and each row gives its tokens alone."""
    model = random_model("diffusion-gemma-tiny")
    with torch.no_grad():  # float32 rounding between layouts stays far below what flips a sample
        model.self_conditioning.mlp.down_proj.weight.mul_(0.2)

    def run(rows):
        batch = Batch(model, samplers.SAMPLERS.create("entropy_bound"), caches.CACHES.create("none"), 8, 4)
        added = [batch.add(prompt, gen, seed) for prompt, gen, seed in rows]
        while batch.running:
            batch.run_block()
        return [batch.answer(row) for row in added], batch

    rows = [(PROMPTS[0], 8, 3), (PROMPTS[1], 16, 4)]  # one block; two
    answers, batch = run(rows)
    alone = [run([row]) for row in rows]
    assert answers == [a[0][0] for a in alone]
    width = batch.canvas.tokens.shape[1]
    assert batch.finish().rows_per_layer[0] == width * sum(a[1].finish().nfe for a in alone)
