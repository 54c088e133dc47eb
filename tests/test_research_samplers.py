"""Prophet, CreditDecoding, LocalLeap, AdaBlock: their reductions to the base decoders, their rules on
hand-made logits, and every sampler x cache x model."""
from types import SimpleNamespace

import pytest
import torch
from conftest import PC_TABLE, random_model
from test_samplers import ctx_for, peaked

import dllm
from dllm import cache as caches
from dllm import samplers
from dllm.core.errors import DllmError
from dllm.engine import decode

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]


def run(model, sampler, cache="none", gen=32, block=8, prepare=None, **params):
    s = samplers.SAMPLERS.create(sampler, **params)
    if prepare is not None:
        s.prepare(prepare)
    return decode(model, PROMPTS, s, caches.CACHES.create(cache), gen, block, stop_early=False, trace=True)


@pytest.fixture(scope="module", params=["llada-tiny", "dream-tiny"])
def model(request):
    return random_model(request.param)


def same(a, b):
    return torch.equal(a[0].tokens, b[0].tokens) and a[1].nfe == b[1].nfe


@pytest.mark.parametrize("base,args", [("low_confidence", {}), ("threshold", {"threshold": 0.3})])
@pytest.mark.parametrize("never", [dict(answer_start=0, early_threshold=1e9, mid_threshold=1e9, late_threshold=1e9),
                                   dict(early_threshold=0.0),  # no answer region: never exits, as the reference
                                   dict(answer_start=32, early_threshold=0.0)])  # a region past the generation
def test_prophet_that_never_fires_is_its_base(model, base, args, never):
    assert same(run(model, "prophet", base=base, **args, **never), run(model, base, **args))


def test_prophet_refuses_an_answer_region_past_the_answer(model):
    """`decode` (the loop) reads a region past the answer as never firing; the calls refuse it before any work."""
    tok = dllm.load("tiny-llada")[1]
    with pytest.raises(DllmError, match=r"^sampler 'prophet' parameter answer_start=32 is past the answer \(32 tokens"):
        dllm.generate(model, tok, ["copy: abcd"], "prophet", answer_start=32, gen_length=32, chat=False)
    with pytest.raises(DllmError, match="answer_start=40 is past"):
        dllm.stream(model, tok, "copy: abcd", "prophet", answer_start=40, gen_length=32, chat=False)
    out = dllm.generate(model, tok, ["copy: abcd"], "prophet", answer_start=31, gen_length=32, chat=False)
    assert len(out.token_ids) == 1


def test_prophet_that_never_fires_draws_as_its_base(model):
    """At T > 0 the base step draws over its block only, as without Prophet (spec 1.7: bit-identical)."""
    never = dict(answer_start=0, early_threshold=1e9, mid_threshold=1e9, late_threshold=1e9)
    assert same(run(model, "prophet", temperature=0.7, **never), run(model, "low_confidence", temperature=0.7))


def test_prophet_in_a_batch_fires_as_alone():
    """Progress counts a row's own forwards: a row whose block is done waits without advancing, as alone."""
    model, tok = dllm.load("tiny-llada")
    args = dict(sampler="prophet", gen_length=64, block_length=4, base="threshold", threshold=0.9, answer_start=0,
                early_threshold=1e9, mid_threshold=1e9, late_threshold=0.0, early_bound=0.0, late_bound=0.1,
                stop_early=False)
    batch = dllm.generate(model, tok, ["copy: z", "add: 0457+0168"], **args)
    assert batch.token_ids[1] == dllm.generate(model, tok, ["add: 0457+0168"], **args).token_ids[0]
    assert batch.token_ids[0] == dllm.generate(model, tok, ["copy: z"], **args).token_ids[0]


def test_prophet_fires_at_once_with_zero_threshold(model):
    canvas, stats, _ = run(model, "prophet", answer_start=3, early_threshold=0.0)
    assert stats.nfe == 1 and not (canvas.tokens == model.config.mask_id).any()
    want, _, _ = run(model, "prophet", base="threshold", threshold=0.0, block=32)  # one-shot argmax of all masks
    assert torch.equal(canvas.tokens, want.tokens)


def test_prophet_gap_under_a_cache_that_skips_decoded_rows_is_refused(model):
    """dkv and elastic compute no logits for most decoded positions, whose gaps Prophet averages."""
    for cache in ("dkv", "elastic"):
        with pytest.raises(DllmError, match=f"sampler 'prophet' reads the logits of decoded tokens, which cache "
                                            f"'{cache}' does not compute; use cache none, prefix or dual"):
            run(model, "prophet", cache, answer_start=0)
    run(model, "prophet", "dkv")  # without a region it reads no decoded logits


def test_prophet_phases():
    p = samplers.SAMPLERS.create("prophet")
    assert p.phase_threshold(torch.tensor([84, 85, 171, 172]) / 256).tolist() == [7.5, 5.0, 5.0, 2.5]


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_credit_without_fusion_is_threshold(model, cache):
    assert same(run(model, "credit", cache, alpha=0.0, threshold=0.3), run(model, "threshold", cache, threshold=0.3))


def test_credit_accumulates_on_a_stable_top_token():
    credit, state = samplers.SAMPLERS.create("credit", threshold=0.75), SimpleNamespace()
    probs = peaked([[0.7, 0.6]])
    first = credit.step(ctx_for(probs, step=0, steps=8, state=state))
    assert first.mask.tolist() == [[True, False]]  # 0.7 < 0.75 but it is the best one
    eligible = torch.tensor([[False, True]])
    second = credit.step(ctx_for(probs, eligible, step=1, steps=8, state=state))
    assert second.confidence[0, 1] > 0.6 and second.tokens[0, 1] == 0
    c = state.credit[0, 1, 0]  # float32, as dInfer's credit matrix
    assert abs(c - (0.7 * 0.6 ** 0.2 + 0.6 ** 0.2)) < 1e-6  # decayed first step + this step
    assert abs(state.credit[0, 0].sum() - 0.7 * 0.7 ** 0.2) < 1e-6  # committed positions earn no more credit


@pytest.mark.parametrize("args", [dict(relaxed_threshold=0.3), dict(radius=0, relaxed_threshold=0.0)])
def test_localleap_reduces_to_threshold(model, args):
    assert same(run(model, "localleap", threshold=0.3, **args), run(model, "threshold", threshold=0.3))


def test_localleap_commits_relaxed_neighbours_of_anchors():
    probs = peaked([[0.8, 0.95, 0.8, 0.8, 0.8, 0.8, 0.8]])
    got = samplers.SAMPLERS.create("localleap", radius=2).step(ctx_for(probs)).mask[0].tolist()
    assert got == [True, True, True, True, False, False, False]
    strict = samplers.SAMPLERS.create("threshold").step(ctx_for(probs)).mask[0]
    assert (strict <= torch.tensor(got)).all()


class Delimiters:
    """A tokenizer stand-in: token 3 is the newline."""

    def get_vocab(self):
        return {"a": 1, "b": 2, "\n": 3}

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens)


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_adablock_disabled_is_fixed_blocks(model, cache):
    ada = run(model, "adablock", cache, prepare=Delimiters(), delimiter_threshold=float("inf"), threshold=0.3)
    assert same(ada, run(model, "threshold", cache, threshold=0.3))


def _block_end(confidences, tokens, start=0, end=8, length=32, tau=0.3, family="llada"):
    """Block end chosen from hand-made logits over [start, start + 8) of a 32-token generation."""
    vocab = 4
    logits = torch.full((1, len(confidences), vocab), -1e9, dtype=torch.float64)
    for i, (c, t) in enumerate(zip(confidences, tokens)):
        logits[0, i] = torch.log(torch.tensor([(1 - c) / (vocab - 1)] * vocab, dtype=torch.float64))
        logits[0, i, t] = torch.log(torch.tensor(c, dtype=torch.float64))
    ada = samplers.SAMPLERS.create("adablock", delimiter_threshold=tau)
    ada.prepare(Delimiters())
    C = len(confidences)
    ctx = ctx_for(logits.exp().tolist(), steps=1)
    ctx.positions, ctx.block_start, ctx.block_end, ctx.prompt_length = torch.arange(start, start + C), start, end, 0
    ctx.canvas, ctx.family = torch.zeros(1, length, dtype=torch.long), family
    return ada.block_end(ctx)


def test_adablock_block_rule():
    assert _block_end([0.9] * 8, [1] * 8) == 8  # no delimiter: fixed block
    assert _block_end([0.9, 0.2, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9], [1, 3, 1, 1, 1, 1, 1, 1]) == 8  # below tau_D
    assert _block_end([0.9, 0.4, 0.9, 0.9, 0.8, 0.9, 0.9, 0.9], [1, 3, 1, 1, 3, 1, 1, 1]) == 5  # most confident
    assert _block_end([0.5] + [0.9] * 7, [3] + [1] * 7) == 1  # delimiter at the block start
    assert _block_end([0.9, 0.5, 0.5, 0.9], [1, 3, 3, 1]) == 2  # ties: lowest position
    by_default = [0.9, 0.4, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9], [1, 3, 1, 1, 1, 1, 1, 1], 0, 8, 32, None
    assert _block_end(*by_default, family="llada") == 2 and _block_end(*by_default, family="dream") == 8  # 0.3 / 0.5


def test_adablock_ends_blocks_on_a_drawn_delimiter_and_commits_that_draw():
    """At T > 0 the reference chooses the block end from Gumbel-drawn tokens (`predicted_tokens`) and commits the
    block's first step from the same draw: a newline drawn below the clean argmax (0.45 vs 0.55) ends blocks."""
    ends = []
    for seed in range(40):
        ada = samplers.SAMPLERS.create("adablock", temperature=1.0, delimiter_threshold=0.3, threshold=2.0)
        ada.prepare(Delimiters())
        ctx = ctx_for([[[0.55, 1e-9, 1e-9, 0.45]] * 8], seed=seed)
        ctx.block_end, ctx.canvas = 8, torch.zeros(1, 32, dtype=torch.long)
        end = ctx.block_end = ada.block_end(ctx)
        ctx.eligible = ctx.positions[None] < end
        tokens = ada.step(ctx).tokens
        assert end == 8 or tokens[0, end - 1] == 3
        ends.append(end)
    assert 8 in ends and min(ends) < 8


def test_adablock_on_an_answer_shorter_than_its_window_fraction(model):
    """gen_length < 4: a quarter of it is no window, so the default block (the reference's fallback)."""
    canvas, _, _ = run(model, "adablock", gen=2, block=2, prepare=Delimiters())
    assert not (canvas.tokens == model.config.mask_id).any()


def test_adablock_shrinks_blocks_on_a_model(model):
    """With every token a delimiter and tau_D = 0 each block ends on its most confident position."""
    every_token = ",".join(map(str, range(model.config.vocab_size)))
    canvas, stats, trace = run(model, "adablock", delimiter_ids=every_token, delimiter_threshold=0.0, threshold=2.0)
    assert not (canvas.tokens == model.config.mask_id).any()
    assert stats.gen_tokens == 64 and stats.nfe == 32  # one token per step, blocks of any size
    assert len({s["block"] for s in trace}) > 4  # more, smaller blocks than the 4 fixed ones


def test_adablock_without_tokenizer_is_a_clear_error(model):
    with pytest.raises(DllmError, match="needs delimiter ids"):
        run(model, "adablock")


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("name", sorted(samplers.SAMPLERS.classes))
def test_every_sampler_runs_over_every_cache(any_model, name, cache):
    model = any_model
    if name.endswith("_test"):
        pytest.skip("registered by another test")
    problem = samplers.SAMPLERS.create(name).check_model(model.config)
    if problem is not None:  # a sampler for another family (insert/delete tokens): refused in one line
        with pytest.raises(DllmError, match=f"sampler {name!r} cannot decode {model.config.arch}: "):
            run(model, name, cache, prepare=Delimiters())
        return
    canvas, stats, trace = run(model, name, cache, prepare=Delimiters(), **(PC_TABLE if name == "pc_sampler" else {}))
    answers = canvas.tokens[canvas.answer]
    assert not (answers == model.config.mask_id).any()
    editing = samplers.SAMPLERS.create(name)
    blocks = len({s["block"] for s in trace})  # 4, or 5 where the first block overlaps the prompt (hierarchy)
    extra = blocks * getattr(editing, "edit_steps", 0)  # token editing: steps after a block's last mask
    assert stats.gen_tokens == answers.numel() and stats.nfe <= 8 * blocks + extra
