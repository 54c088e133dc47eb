"""The decode loop with the baseline and Fast-dLLM samplers over none/prefix/dual caches (spec
baseline_and_fastdllm.md section 6)."""
import pytest
import torch
from conftest import random_model

from dllm import cache as caches
from dllm import samplers
from dllm.engine import decode
from dllm.engine.canvas import Canvas
from dllm.models import Rows

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
MODELS = ["llada-tiny", "dream-tiny"]


def run(model, prompts=PROMPTS, sampler="low_confidence", cache="none", gen=32, block=8, steps=None,
        sampler_args=None, cache_args=None, **kw):
    return decode(model, prompts, samplers.SAMPLERS.create(sampler, **(sampler_args or {})),
                  caches.CACHES.create(cache, **(cache_args or {})), gen, block, steps, stop_early=False, **kw)


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    return random_model(request.param)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("sampler,args", [("low_confidence", {}), ("threshold", {"threshold": 0.3})])
def test_refresh_every_step_equals_no_cache(model, cache, sampler, args):
    want, want_stats, _ = run(model, sampler=sampler, sampler_args=args)
    got, stats, _ = run(model, sampler=sampler, sampler_args=args, cache=cache, cache_args={"refresh_every": 1})
    assert torch.equal(got.tokens, want.tokens)
    assert stats.nfe == want_stats.nfe == stats.full_forwards


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_block_caches_approximate_but_finish(model, cache):
    got, stats, _ = run(model, cache=cache)
    assert stats.full_forwards == 32 // 8  # one refresh per block
    assert not (got.tokens == model.config.mask_id).any()


def test_fresh_cache_reproduces_full_forward(model):
    """Right after a refresh, a dual (block) or prefix (suffix) forward gives the full forward's logits."""
    canvas = Canvas.build(model, PROMPTS, 16)
    L, s, e = canvas.tokens.shape[1], canvas.prompt_length, canvas.prompt_length + 8
    shift = model.config.logit_shift
    kv = caches.CACHES.create("dual").new_kv(model, 2, L)
    with torch.no_grad():
        full = model.run(canvas.tokens, canvas.positions, canvas.key_mask, kv)
        for rows in (slice(s - shift, e), slice(s - shift, L), torch.arange(s - shift, e)):
            part = model.run(canvas.tokens[:, rows], canvas.positions[:, rows], canvas.key_mask, kv, Rows(rows))
            assert (part - full[:, rows]).abs().max() < 1e-5


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_padded_row_equals_prompt_alone(model, cache):
    batch, _, _ = run(model, cache=cache, sampler="threshold", sampler_args={"threshold": 0.5})
    for row, prompt in enumerate(PROMPTS):
        alone, _, _ = run(model, prompts=[prompt], cache=cache, sampler="threshold", sampler_args={"threshold": 0.5})
        assert torch.equal(batch.tokens[row, batch.prompt_length:], alone.tokens[0, alone.prompt_length:])


def test_vanilla_is_deterministic_one_token_per_step(model):
    a, stats, trace = run(model, steps=32, trace=True)
    b, _, _ = run(model, steps=32)
    assert torch.equal(a.tokens, b.tokens)
    assert stats.nfe == 32 and stats.gen_tokens == 64
    assert all(len(row) == 1 for step in trace for row in step["commits"])


def test_callback_sees_each_step_and_its_commits(model):
    seen = []
    _, stats, trace = run(model, sampler="threshold", sampler_args={"threshold": 0.3}, trace=True,
                          callback=seen.append)
    assert [(s["block"], s["step"]) for s in seen] == [(s["block"], s["step"]) for s in trace]
    assert [s["committed"] for s in seen] == [sum(map(len, s["commits"])) for s in trace]
    assert sum(s["committed"] for s in seen) == stats.gen_tokens == 2 * 32


def test_threshold_above_one_is_vanilla(model):
    want, want_stats, _ = run(model)
    got, stats, _ = run(model, sampler="threshold", sampler_args={"threshold": 1.01})
    assert torch.equal(got.tokens, want.tokens) and stats.nfe == want_stats.nfe == 32


@pytest.mark.parametrize("tau", [0.0, 0.2, 0.6])
def test_threshold_commits_between_one_and_all(model, tau):
    _, stats, trace = run(model, sampler="threshold", sampler_args={"threshold": tau}, trace=True)
    masks_left = {0: 32, 1: 32}
    for step in trace:
        for row, commits in enumerate(step["commits"]):
            left_in_block = 8 - sum(1 for s in trace[:trace.index(step)] if s["block"] == step["block"]
                                    for _ in s["commits"][row])
            if left_in_block:
                assert 1 <= len(commits) <= left_in_block
            assert all(c["confidence"] >= tau for c in commits[1:]) or tau == 0
            masks_left[row] -= len(commits)
    assert masks_left == {0: 0, 1: 0}
    if tau == 0.0:
        assert stats.nfe == 4  # everything in the block commits at once


def test_rows_per_layer_match_closed_forms(model):
    """Cost model of spec 4.5 with one token per step: n_k = block length steps in every block."""
    P, G, Bk, B = 7, 32, 8, 2
    L, K, shift = P + G, G // Bk, model.config.logit_shift
    expected = {
        "none": G * L,
        "prefix": sum(L + (Bk - 1) * (L - (P + k * Bk) + shift) for k in range(K)),
        "dual": sum(L + (Bk - 1) * (Bk + shift) for k in range(K)),
    }
    for cache, rows in expected.items():
        _, stats, _ = run(model, cache=cache)
        assert stats.rows_per_layer == [B * rows] * model.config.n_layers, cache
    _, stats, _ = run(model, cache="dual")
    cfg = model.config
    assert stats.cache_bytes == 2 * cfg.n_layers * B * cfg.n_kv_heads * L * cfg.head_dim * 4


def test_finished_rows_get_filler_and_stop(model):
    cfg = model.config
    canvas = Canvas.build(model, [[5, 6], [7, 8]], 6)
    M, S = cfg.mask_id, cfg.stop_ids[0]
    canvas.tokens[:, 2:] = torch.tensor([[1, S, M, 3, M, M], [M, S, M, M, M, M]])
    finished = canvas.finish_rows(torch.zeros(2, dtype=torch.bool), cfg)
    assert finished.tolist() == [True, False]  # row 1 still has a mask before its stop token
    assert canvas.tokens[0, 2:].tolist() == [1, S, cfg.filler_id, 3, cfg.filler_id, cfg.filler_id]
    assert (canvas.tokens[1, 2:] == torch.tensor([M, S, M, M, M, M])).all()


class RecordingStore(caches.KVStore):
    """Keeps every layer's hidden input (as Elastic-Cache does) and can expand to all rows at one layer."""

    def __init__(self, model, canvas, expand_at=None, probe=None):
        cfg = model.config
        B, L = canvas.tokens.shape
        super().__init__(model.kv_shapes(), B, L, torch.float32, torch.device("cpu"))
        self.hidden = [torch.zeros(B, L, cfg.hidden_size) for _ in range(cfg.n_layers)]
        self.positions, self.expand_at, self.probe, self.seen = canvas.positions, expand_at, probe, {}

    def expand(self, layer, rows, x):
        self.hidden[layer][:, rows.index] = x
        if layer != self.expand_at:
            return None
        self.grown_at = layer
        return self.hidden[layer].clone(), self.positions

    def count(self, rows, canvas_rows):
        self.rows_per_layer = [n + (rows if layer < self.grown_at else canvas_rows)
                               for layer, n in enumerate(self.rows_per_layer)]

    def attention_rows(self, layer, rows):
        return self.probe

    def observe_attention(self, layer, rows, probs):
        self.seen[layer] = probs


@pytest.mark.parametrize("layer", [0, 1])
def test_recompute_from_a_chosen_layer_restores_the_full_forward(model, layer):
    canvas = Canvas.build(model, PROMPTS, 16)
    L, s, e = canvas.tokens.shape[1], canvas.prompt_length, canvas.prompt_length + 8
    kv = RecordingStore(model, canvas, expand_at=layer)
    with torch.no_grad():
        model.run(canvas.tokens, canvas.positions, canvas.key_mask, kv)  # refresh: fills every store
        kv.count(2 * L, 2 * L)
        canvas.tokens[:, s:s + 3] = torch.tensor([20, 21, 22])  # commits inside the block
        want = model.run(canvas.tokens, canvas.positions, canvas.key_mask, None)[:, s:e]
        got = model.run(canvas.tokens[:, s:e], canvas.positions[:, s:e], canvas.key_mask, kv, Rows(slice(s, e)),
                        torch.arange(8).expand(2, -1))
        kv.count(2 * (e - s), 2 * L)
    if layer == 0:  # stale rows are all unchanged tokens: exact
        assert (got - want).abs().max() < 1e-5
    else:  # layer-0 K/V of the block are fresh but deeper rows outside it were computed before the commits
        assert (got - want).abs().max() > 1e-6
    assert kv.rows_per_layer[-1] == 2 * (L + L)  # the last layer ran every row twice


def test_attention_probabilities_of_chosen_rows(model):
    canvas = Canvas.build(model, PROMPTS, 8)
    L = canvas.tokens.shape[1]
    probe = torch.tensor([[0, 3], [4, 9]])
    kv = RecordingStore(model, canvas, probe=probe)
    with torch.no_grad():
        model.run(canvas.tokens, canvas.positions, canvas.key_mask, kv)
    probs = kv.seen[0]
    assert probs.shape == (2, model.config.n_heads, 2, L)
    assert torch.allclose(probs.sum(-1), torch.ones(2, model.config.n_heads, 2))
    assert (probs[1, :, :, :4] == 0).all()  # row 1 is left-padded by 4: pads get no attention
    # layer 0 by hand: softmax(q k^T / sqrt(d)) of the embedded, normed inputs
    block, cfg = model.layers[0], model.config
    h = block.attn_norm(model.embed(canvas.tokens))
    cos, sin = model.rope_tables(canvas.positions)
    from dllm.models.transformer import qkv_sizes, rope
    q, k, _ = block.qkv_proj(h).split(qkv_sizes(cfg), -1)
    q = rope(q.view(2, L, cfg.n_heads, -1).transpose(1, 2), cos, sin)
    k = rope(k.view(2, L, cfg.n_kv_heads, -1).transpose(1, 2), cos, sin)
    k = k.repeat_interleave(cfg.n_heads // cfg.n_kv_heads, 1)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~canvas.key_mask, float("-inf")).softmax(-1)
    want = torch.stack([scores[b, :, probe[b]] for b in range(2)])
    assert (probs - want).abs().max() < 1e-6


@pytest.mark.parametrize("sampler,cache", [("credit", "none"), ("random", "dkv_greedy")])
def test_one_sampler_object_decodes_batches_in_parallel_threads(model, sampler, cache):
    """Per-run sampler state lives with the loop, not on the sampler: two threads sharing one stateful sampler
    (CreditDecoding's credits, random's order) give what each gives alone."""
    from concurrent.futures import ThreadPoolExecutor

    shared = samplers.SAMPLERS.create(sampler)
    prompts = [PROMPTS, [[20, 21], [22, 23, 24, 25]]]

    def one(p):
        return decode(model, p, shared, caches.CACHES.create(cache), 32, 8, stop_early=False)[0].tokens

    alone = [one(p) for p in prompts]
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(one, prompts * 3))
    assert all(torch.equal(t, alone[i % 2]) for i, t in enumerate(together))


EDITING = [cls.name for cls in samplers.SAMPLERS if cls.edits]
GSM8K_LIKE = ["reverse: abc12", "sort: 42,07,19,03", "add: 0457+0168", "copy: k3x9a", "reverse: hello", "add: 12+34"]


@pytest.mark.parametrize("name", EDITING)
def test_a_sampler_that_edits_stops_early_with_the_answer_decoded_to_the_end(tiny_llada, name):
    """Stopping early never ends a row while a token before its stop may still be edited (issue 52 item 1): the
    answers equal those decoded to the end (WINO's GSM8K setting: gen 128, block 64, thresholds 0.6 / 0.9)."""
    from dllm.engine.decoding import decoded
    from dllm.engine.text import encode_prompts

    model, tok = tiny_llada
    prompts, lengths = encode_prompts(tok, GSM8K_LIKE, chat=True), (128, 64)
    if name == "joint_threshold_indel":  # writes the delete and split tokens: a model that has them, leaning to stop
        model = random_model("llada2.2-tiny")
        with torch.no_grad():
            model.lm_head.weight[[*model.config.edit_ids, *model.config.stop_ids]] *= 40
        prompts, lengths = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [20, 21]], (32, 8)
    sampler = samplers.SAMPLERS.create(name, **({"threshold": 0.6, "remask_threshold": 0.9} if name == "wino" else {}))
    early, full = (decoded(model, prompts, sampler, caches.CACHES.create("none"), *lengths, stop_early=stop)
                   for stop in (True, False))
    assert [early.answer(row) for row in early.rows] == [full.answer(row) for row in full.rows]
    assert any(early.answer(row) != full.canvas.tokens[b, full.canvas.gen_start[b]:].tolist()
               for b, row in enumerate(early.rows))  # some row stopped before its canvas's end
