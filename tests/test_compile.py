"""The compiled forward (`--compile`): one graph with no breaks for the caches whose rows are slices, the same
tokens as the eager loop, and a clear refusal for the caches that pick rows token by token."""
import dataclasses
import math
import re

import pytest
import torch
from conftest import random_model

import dllm
from dllm import cache as caches
from dllm.cache.base import gather_rows
from dllm.core.errors import DllmError
from dllm.engine import decode
from dllm.engine.canvas import Canvas
from dllm.engine.options import split_params
from dllm.engine.runner import compiled_run
from dllm.models import DiffusionLM, Rows
from dllm.samplers import SAMPLERS

PROMPTS = [[5, 6, 7, 8], [9, 10]]


@pytest.mark.parametrize("preset", ["llada-tiny", "dream-tiny"])
@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_the_block_step_is_one_graph(preset, cache):
    """What `Runner` hands the compiled `model.run` (rows as a position tensor, the logit rows as a tensor)
    traces to one graph, padded batch included; the compiled call then gives the eager logits."""
    model = random_model(preset)
    canvas = Canvas.build(model, PROMPTS, 16)
    B, L = canvas.tokens.shape
    s, shift = canvas.prompt_length, model.config.logit_shift
    kv = caches.CACHES.create(cache).new_kv(model, B, L)
    block = {"none": (0, L), "prefix": (s - shift, L), "dual": (s - shift, s + 8)}[cache]
    rows = Rows(torch.arange(*block))
    key_mask = canvas.key_mask if kv.nbytes else canvas.key_mask[..., rows.index]
    args = (gather_rows(canvas.tokens, rows), gather_rows(canvas.positions, rows), key_mask, kv, rows,
            torch.arange(s - shift - block[0], s - shift - block[0] + 8).expand(B, -1))
    with torch.no_grad():
        model.run(canvas.tokens, canvas.positions, canvas.key_mask, kv)  # a refresh fills the store
        explained = torch._dynamo.explain(model.run)(*args)
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
        want = model.run(*args)
        got = torch.compile(model.run, fullgraph=True, backend="aot_eager")(*args)
    assert (got - want).abs().max() < 1e-5


@pytest.fixture(scope="module")
def tiny_llada():
    return dllm.load("tiny-llada")


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_compiled_decoding_gives_the_eager_tokens(tiny_llada, cache):
    """Inductor-compiled, on the shipped model, a padded batch: the same tokens and forwards as eager (which leaves
    a row with nothing left to decode in a block out of the forward; compiled keeps the batch's shape)."""
    model, tok = tiny_llada
    prompts = ["reverse: hello123", "copy: ab"]
    want = dllm.generate(model, tok, prompts, "threshold", cache, stop_early=False)
    got = dllm.generate(model, tok, prompts, "threshold", cache, stop_early=False, compile=True)
    assert torch.equal(got.sequences, want.sequences)
    assert got.stats.nfe == want.stats.nfe
    assert all(a >= b for a, b in zip(got.stats.rows_per_layer, want.stats.rows_per_layer))


@pytest.mark.parametrize("cache", ["dkv", "elastic"])
def test_caches_that_pick_rows_token_by_token_refuse_compile(tiny_llada, cache):
    model, tok = tiny_llada
    with pytest.raises(DllmError, match=f"cache '{cache}' chooses its rows token by token and runs eagerly; "
                                        "drop --compile"):
        dllm.generate(model, tok, "copy: ab", cache=cache, compile=True)


@pytest.mark.parametrize("sampler", [cls.name for cls in SAMPLERS])
def test_every_sampler_decodes_the_eager_tokens_compiled(tiny_llada, sampler):
    """--compile changes the forward only: every sampler (drafts verified on a forked store included) commits the
    eager tokens in the eager number of forwards over the dual cache."""
    model, tok = tiny_llada
    if SAMPLERS.create(sampler).check_model(model.config):
        pytest.skip("refused on this model in one line (tests/test_research_samplers.py)")
    prompts = ["reverse: hello123", "copy: ab"]
    want = dllm.generate(model, tok, prompts, sampler, "dual", stop_early=False)
    got = dllm.generate(model, tok, prompts, sampler, "dual", stop_early=False, compile=True)
    assert torch.equal(got.sequences, want.sequences) and got.stats.nfe == want.stats.nfe


def test_the_compiled_cached_forward_writes_the_store_in_place():
    """Inductor's code for a dual-cache block step allocates nothing as large as one layer's keys: the fresh keys
    and values go into the store where it is (a store made of views of one buffer was copied whole at every
    layer, 3.6x slower at batch 8)."""
    from torch._inductor.utils import run_and_get_code

    model = random_model("llada-tiny")
    canvas = Canvas.build(model, PROMPTS, 256)
    B, L = canvas.tokens.shape
    s = canvas.prompt_length
    kv = caches.CACHES.create("dual").new_kv(model, B, L)
    rows = Rows(torch.arange(s, s + 32))
    args = (gather_rows(canvas.tokens, rows), gather_rows(canvas.positions, rows), canvas.key_mask, kv, rows,
            torch.arange(32).expand(B, -1))
    with torch.no_grad():
        model.run(canvas.tokens, canvas.positions, canvas.key_mask, kv)
        want = model.run(*args)
        got, (code, *_) = run_and_get_code(torch.compile(model.run, fullgraph=True), *args)
    assert (got - want).abs().max() < 1e-5
    allocated = [math.prod(int(n) for n in shape.split(",") if n.strip())
                 for shape in re.findall(r"empty_strided_\w+\(\(([\d, ]+)\)", code)]
    assert allocated and max(allocated) < kv.k[0].numel(), sorted(allocated)[-3:]


def test_each_layer_calls_the_code_compiled_once_for_all_layers():
    """The work before and after attention is compiled once and called by every layer (nested compile regions):
    inductor's code for a 4-layer model defines two regions and calls each four times."""
    from torch._inductor.utils import run_and_get_code

    model = DiffusionLM(dataclasses.replace(random_model("llada-tiny").config, n_layers=4)).eval()
    canvas = Canvas.build(model, PROMPTS, 16)
    with torch.no_grad():
        _, (code, *_) = run_and_get_code(compiled_run(model), canvas.tokens, canvas.positions, canvas.key_mask)
    assert len(re.findall(r"^def repeated_subgraph\d+\(", code, re.M)) == 2
    calls = re.findall(r"= (repeated_subgraph\d+)\(", code)
    assert len(calls) == 8 and all(calls.count(name) == 4 for name in calls), calls


def test_models_with_other_norm_eps_compile_in_one_process():
    """A region takes tensors only: a model's float constants (RMSNorm eps: Dream 1e-6, LLaDA 1e-5) are compiled
    in, not passed, so a second model with another eps compiles and decodes the eager tokens."""
    for preset in ("dream-tiny", "llada-tiny"):
        model = random_model(preset)
        sampler, cache = split_params("threshold", "dual", {})
        want, _, _ = decode(model, [[5, 6, 7, 8]], sampler, cache, 16, 8)
        got, _, _ = decode(model, [[5, 6, 7, 8]], sampler, cache, 16, 8, compile=True)
        assert torch.equal(got.tokens, want.tokens), preset


def test_the_store_lender_hands_a_returned_store_back_zeroed_and_keeps_a_few():
    """A store given back is lent again whole, its tensors in their order (the addresses CUDA graphs were
    recorded with), zeroed; another shape, dtype or count gets new tensors; only `keep` returned stores are held."""
    from dllm.engine.runner import StoreLender

    cpu = torch.device("cpu")
    lender = StoreLender(keep=2)
    first = lender.take([(2, 3)] * 3, torch.float32, cpu)
    for i, t in enumerate(first):
        t.fill_(i + 1.0)
    lender.give_back(first)
    again = lender.take([(2, 3)] * 3, torch.float32, cpu)
    assert [id(t) for t in again] == [id(t) for t in first] and not any(t.any() for t in again)
    lender.give_back(again)
    for shapes, dtype in (([(2, 3)] * 3, torch.bfloat16), ([(2, 3)] * 2, torch.float32),
                          ([(2, 3), (2, 3), (3, 2)], torch.float32)):  # another dtype, count, or one layer's shape
        assert not {id(t) for t in lender.take(shapes, dtype, cpu)} & set(map(id, first))
    others = [lender.take([(n,)], torch.float32, cpu) for n in (1, 2, 3)]
    for store in others:
        lender.give_back(store)
    assert lender.free == [others[2], others[1]]  # the latest two


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("sampler, cache", [("threshold", "none"), ("threshold", "dual"), ("speculative", "dual")])
def test_cuda_graphs_give_the_eager_tokens_on_one_lent_store(sampler, cache):
    """On a GPU the compiled forward replays CUDA graphs (none skipped, draft verification on a forked store
    included): the eager tokens, and a second generation of the same shape decodes on the first one's stores, the
    addresses its graphs were recorded with."""
    from torch._dynamo.utils import counters

    from dllm.engine.runner import store_lender

    model, tok = dllm.load("tiny-llada", device="cuda")
    prompts = ["reverse: hello123", "copy: ab"]
    want = dllm.generate(model, tok, prompts, sampler, cache, stop_early=False)
    counters["inductor"]["cudagraph_skips"] = 0
    first = dllm.generate(model, tok, prompts, sampler, cache, stop_early=False, compile=True)
    lent = [t.data_ptr() for store in store_lender(model).free for t in store]
    second = dllm.generate(model, tok, prompts, sampler, cache, stop_early=False, compile=True)
    assert torch.equal(first.sequences, want.sequences) and torch.equal(second.sequences, want.sequences)
    assert first.stats.nfe == want.stats.nfe
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert bool(lent) == (cache != "none") and [t.data_ptr() for store in store_lender(model).free for t in store] == lent
