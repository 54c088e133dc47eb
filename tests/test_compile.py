"""The compiled forward (`--compile`): one graph with no breaks for the caches whose rows are slices, the same
tokens as the eager loop, and a clear refusal for the caches that pick rows token by token."""
import pytest
import torch
from conftest import random_model

import dllm
from dllm import cache as caches
from dllm.cache.base import gather_rows
from dllm.engine import Canvas
from dllm.errors import DllmError
from dllm.models import Rows

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
    """Inductor-compiled, on the shipped model, a padded batch: the same tokens and forwards as eager."""
    model, tok = tiny_llada
    prompts = ["reverse: hello123", "copy: ab"]
    want = dllm.generate(model, tok, prompts, "threshold", cache, stop_early=False)
    got = dllm.generate(model, tok, prompts, "threshold", cache, stop_early=False, compile=True)
    assert torch.equal(got.sequences, want.sequences)
    assert got.stats.nfe == want.stats.nfe and got.stats.rows_per_layer == want.stats.rows_per_layer


@pytest.mark.parametrize("cache", ["dkv", "elastic"])
def test_caches_that_pick_rows_token_by_token_refuse_compile(tiny_llada, cache):
    model, tok = tiny_llada
    with pytest.raises(DllmError, match=f"cache '{cache}' chooses its rows token by token and runs eagerly; "
                                        "drop --compile"):
        dllm.generate(model, tok, "copy: ab", cache=cache, compile=True)


def test_the_store_lender_hands_a_returned_buffer_back_zeroed_and_keeps_a_few():
    """A buffer given back is lent again (the address a CUDA graph was recorded with), zeroed; another shape or
    dtype gets a new one; only `keep` returned buffers are held."""
    from dllm.engine import StoreLender

    lender = StoreLender(keep=2)
    first = lender.take((2, 3), torch.float32, torch.device("cpu"))
    first.fill_(7.0)
    lender.give_back(first)
    again = lender.take((2, 3), torch.float32, torch.device("cpu"))
    assert again is first and not again.any()
    assert lender.take((2, 3), torch.bfloat16, torch.device("cpu")) is not first
    others = [lender.take((n,), torch.float32, torch.device("cpu")) for n in (1, 2, 3)]
    for buffer in [again, *others]:
        lender.give_back(buffer)
    assert [id(b) for b in lender.free] == [id(others[2]), id(others[1])]  # the latest two


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("cache", ["none", "dual"])
def test_cuda_graphs_give_the_eager_tokens_on_one_lent_store(cache):
    """On a GPU the compiled forward replays CUDA graphs (none skipped): the eager tokens, and a second generation
    of the same shape decodes on the first one's store buffer, the address its graphs were recorded with."""
    from torch._dynamo.utils import counters

    from dllm.engine import store_lender

    model, tok = dllm.load("tiny-llada", device="cuda")
    prompts = ["reverse: hello123", "copy: ab"]
    want = dllm.generate(model, tok, prompts, "threshold", cache, stop_early=False)
    counters["inductor"]["cudagraph_skips"] = 0
    first = dllm.generate(model, tok, prompts, "threshold", cache, stop_early=False, compile=True)
    lent = [buffer.data_ptr() for buffer in store_lender(model).free]
    second = dllm.generate(model, tok, prompts, "threshold", cache, stop_early=False, compile=True)
    assert torch.equal(first.sequences, want.sequences) and torch.equal(second.sequences, want.sequences)
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert len(lent) == (cache != "none") and [buffer.data_ptr() for buffer in store_lender(model).free] == lent
