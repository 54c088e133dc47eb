"""d2Cache (issue #46 item 2): the `certainty_prior` sampler and the `d2cache` cache against a plain transcription
of Kamichanw/d2Cache (`src/generation/vanilla.py` generate loop, `src/cache/d2cache.py`, `src/utils/common.py`),
token for token and forward for forward on the shipped tiny models (the spec's fidelity configurations,
strategies_2026.md); the frozen first-step confidences and the flag that refreshes them; batching; composition."""
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import random_model

import dllm
from dllm import cache as caches
from dllm import samplers
from dllm.core.density import certainty_density
from dllm.core.errors import DllmError
from dllm.engine import decode
from dllm.engine.text import encode_prompts
from dllm.models.transformer import head

PROMPTS = ["reverse: abc12", "sort: 42,07,19,03", "add: 0457+0168", "copy: k3x9a"]
HARD = PROMPTS[1:3]  # the longest answers: most decisions per decode


@pytest.fixture(scope="module", params=["tiny-llada", "tiny-dream"])
def tiny(request):
    return dllm.load(request.param)


# ---- the transcription (batch 1, step by step) -------------------------------------------------------------------

def reference_density(decoded, sigma):
    """`certainty_density` of `common.py` for one row `[G]`: the answer between G decoded positions on the left and
    G on the right that copy its last one, convolved with exp(-d^2 / 2 sigma^2) by a float32 FFT over 6G points,
    divided by the kernel's sum."""
    g = decoded.shape[0]
    padded = torch.cat([torch.ones(g), decoded.float(), torch.full((g,), 1.0 if decoded[-1] else 0.0)])
    n = 6 * g
    dist = torch.cat([torch.arange(3 * g), torch.arange(-3 * g, 0)])
    kernel = torch.fft.fft(torch.exp(-(dist ** 2) / (2 * sigma ** 2)), n=n)
    weighted = torch.fft.ifft(torch.fft.fft(torch.cat([padded, torch.zeros(3 * g)]), n=n) * kernel, n=n).real
    total = torch.fft.ifft(torch.fft.fft(torch.ones(n), n=n) * kernel, n=n).real
    return weighted[g:2 * g] / total[g:2 * g].clamp_min(1e-8)


def reference_nucleus(scores, top_p, mask):
    """`nucleus_select(scores, top_p, min_k=1, mask)` for one row."""
    scores = torch.where(mask, scores, 0.0)
    probs = scores / (scores.sum() + 1e-9)
    sorted_probs, order = torch.sort(probs, descending=True)
    keep = (torch.cumsum(sorted_probs, 0) <= top_p) | (torch.arange(len(scores)) < 1)
    keep &= mask[order]
    return torch.zeros_like(mask).scatter(0, order, keep)


class ReferenceD2Cache:
    """`d2Cache` for one row: keys and values of every position per layer (rotated: RoPE is the same whenever it
    is applied), the attention rollout of the last forward, the first step's confidences, the query mask of the
    next forward. `update_confidence` makes the confidence write land (the line its authors wrote, which writes
    into a copy in their code)."""

    def __init__(self, k, p, sigma, inflate, update_confidence=False):
        self.k, self.p, self.sigma, self.inflate, self.update_confidence = k, p, sigma, inflate, update_confidence
        self.keys, self.values, self.conf, self.q_mask = [], [], None, None

    def on_step_end(self, block_mask, x_before, x_after, confidence, transfer_index, prompt_length, mask_id, shift):
        P, G = prompt_length, len(block_mask)
        if self.conf is None:
            self.conf = confidence.clone()
        remaining = x_after[P:] == mask_id
        if self.q_mask is not None and self.update_confidence:  # LLaDA: the computed rows; Dream: their successors
            computed = self.q_mask[P - shift:P - shift + G]
            valid = computed & (x_before[P:] == mask_id)
            self.conf = torch.where(valid, confidence, self.conf)
        block_size = int(block_mask.sum())
        meets = torch.cumsum(remaining.int(), 0) >= self.k
        min_end = int(torch.argmax(meets.int())) if meets.any() else G - 1
        search_end = (min_end // block_size + 1) * block_size - 1
        block_start = int(torch.argmax(block_mask.int()))
        cols = torch.arange(G)
        search = (cols >= block_start) & (cols <= search_end)
        scores = self.conf * reference_density(~remaining, self.sigma)
        scores[block_mask] += scores.max()
        indices = torch.topk(torch.where(search & remaining, scores, -torch.inf), k=min(self.k, G)).indices
        selected = torch.zeros(G, dtype=torch.bool).scatter(0, indices, True) & remaining
        response = F.pad(selected[1:], (0, 1), value=False) if shift else selected.clone()
        response[transfer_index] = True
        q = F.pad(response, (P, 0), value=False)
        q |= reference_nucleus(self.rollout.sum(0), self.p, ~q)
        if shift:
            q[P - 1] = selected[0]
        if self.inflate > 0:
            t = len(q)
            ar = torch.arange(t)
            nxt = torch.flip(torch.cummin(torch.flip(torch.where(q, ar, t), [0]), 0).values, [0])
            prv = torch.cummax(torch.where(q, ar, -1), 0).values
            q |= ((nxt - ar) + (ar - prv) <= self.inflate) & (prv >= 0) & (nxt < t)
        self.q_mask = q


def reference_forward(model, x, cache):
    """The model over canvas `x` `[T]` with `d2Cache.model_forward` / `attention`: the rows of `cache.q_mask` (all
    at the first forward) computed, their keys and values written into the cache, eager attention (explicit
    softmax), the rollout accumulated; raw logits `[T, V]`, zero at the rows not computed. Returns also the rows
    computed."""
    T = len(x)
    active = torch.ones(T, dtype=torch.bool) if cache is None or cache.q_mask is None else cache.q_mask
    positions = torch.arange(T)[active][None]
    h = model.embed(x[active])[None]
    cos, sin = model.rope_tables(positions)
    rollout = torch.eye(T)
    for layer, block in enumerate(model.layers):
        qk, v = block.attention_inputs(h, cos, sin)
        q, k = qk.split((block.n_heads, block.n_kv_heads), 1)
        if cache is not None:
            if len(cache.keys) <= layer:
                cache.keys.append(k)
                cache.values.append(v)
            else:
                cache.keys[layer][:, :, active] = k
                cache.values[layer][:, :, active] = v
            k, v = cache.keys[layer], cache.values[layer]
        k = k.repeat_interleave(block.n_heads // block.n_kv_heads, 1)
        v = v.repeat_interleave(block.n_heads // block.n_kv_heads, 1)
        weights = torch.softmax(torch.matmul(q, k.transpose(2, 3)) / math.sqrt(q.size(-1)), dim=-1,
                                dtype=torch.float32)
        h = block.output_and_mlp(h, torch.matmul(weights, v))
        effective = weights.mean(1)[0] if cache is None or cache.q_mask is None else torch.eye(T)
        if cache is not None and cache.q_mask is not None:
            effective[active] = weights.mean(1)[0]
        residual = effective + torch.eye(T)
        residual = residual / residual.sum(-1, keepdim=True)
        rollout = residual @ rollout
    if cache is not None:
        cache.rollout = rollout
    logits = torch.zeros(T, model.config.vocab_size)
    logits[active] = head(model.norm(h), model.lm_head.weight)[0]
    return logits, int(active.sum())


@torch.no_grad()
def reference_generate(model, prompt, gen_length, block_length, sigma, cache=None):
    """`vanilla_generate` with one token per step (num_transfer_tokens 1), temperature 0, maskgit_plus confidence,
    the certainty prior `sigma` (None: off) and optionally a `ReferenceD2Cache`. Returns the answer, the forwards
    and the rows computed at each. The one change: MASK's logit is -inf (the toolkit never proposes MASK)."""
    cfg = model.config
    mask_id, shift, P = cfg.mask_id, cfg.logit_shift, len(prompt)
    x = torch.tensor(prompt + [mask_id] * gen_length)
    rows = []
    for b in range(gen_length // block_length):
        block_mask = torch.zeros(gen_length, dtype=torch.bool)
        block_mask[b * block_length:(b + 1) * block_length] = True
        while ((x[P:] == mask_id) & block_mask).any():
            remaining = x[P:] == mask_id
            logits, computed = reference_forward(model, x, cache)
            rows.append(computed)
            logits[:, mask_id] = -torch.inf
            if shift:  # Dream: position i is predicted by row i - 1
                logits = torch.cat([logits[:1], logits[:-1]])
            # (vanilla.py restricts the candidates to the computed rows with `logical_and_` on a copy: a no-op)
            confidence, x0 = torch.softmax(logits[P:], -1).max(-1)
            confidence = torch.where(remaining, confidence, -torch.inf)
            scores = confidence * reference_density(~remaining, sigma) if sigma else confidence
            index = torch.topk(torch.where(remaining & block_mask, scores, -torch.inf), 1).indices
            before = x.clone()
            x[P + index] = x0[index]
            if cache is not None:
                cache.on_step_end(block_mask, before, x, confidence, index, P, mask_id, shift)
    return x[P:].tolist(), len(rows), rows


def ours(model, tok, prompt, gen_length, block_length, prior, cache="none", **cache_args):
    """Our decode of `prompt` with the certainty prior `prior` over `cache`: the answer, the forwards, the rows
    computed at each, the cache object."""
    ids = encode_prompts(tok, [prompt], chat=True)
    sampler = samplers.SAMPLERS.create("certainty_prior", sigma=prior)
    policy = caches.CACHES.create(cache, **cache_args)
    canvas, stats, trace = decode(model, ids, sampler, policy, gen_length, block_length, stop_early=False,
                                  trace=True)
    return (canvas.tokens[0, canvas.prompt_length:].tolist(), stats.nfe,
            [step["rows_per_layer"][0] for step in trace], policy)


@pytest.fixture(autouse=True)
def _keep_stores(monkeypatch):
    """Every d2cache made in a test keeps its last store in `.kept`."""
    make = caches.CACHES.get("d2cache").new_kv

    def new_kv(self, *args, **kwargs):
        self.kept = make(self, *args, **kwargs)
        return self.kept
    monkeypatch.setattr(caches.CACHES.get("d2cache"), "new_kv", new_kv)


# ---- tests ---------------------------------------------------------------------------------------------------------

def test_certainty_density_is_the_fft_of_the_formula():
    """Bit for bit the transcription's FFT path, and equal (to float noise) to the sum it computes: ones on the
    left, the last position's value on the right."""
    gen = torch.Generator().manual_seed(0)
    decoded = torch.rand(3, 24, generator=gen) < 0.4
    decoded[1, -1], decoded[2, -1] = True, False
    for sigma in (10.0, 2.0, 0.7):
        got = certainty_density(decoded, sigma)
        for b in range(3):
            assert torch.equal(got[b], reference_density(decoded[b], sigma))
            g = decoded.shape[1]
            ext = torch.cat([torch.ones(g), decoded[b].double(), torch.full((g,), float(decoded[b, -1]))])
            kernel = lambda d: torch.exp(-d.double() ** 2 / (2 * sigma ** 2))  # noqa: E731
            want = torch.stack([(ext * kernel(torch.arange(-g, 2 * g) - i)).sum() for i in range(g)])
            assert torch.allclose(got[b].double(), want / kernel(torch.arange(-3 * g, 3 * g)).sum(), atol=1e-5)


@pytest.mark.parametrize("sigma", [10.0, 2.0])
def test_certainty_prior_decoding_equals_the_transcription(tiny, sigma):
    """Configurations (a) and (b): G 32 = B, top-1 by confidence x density, no cache."""
    model, tok = tiny
    for prompt in PROMPTS if sigma == 10.0 else HARD:
        ids = encode_prompts(tok, [prompt], chat=True)[0]
        want, forwards, _ = reference_generate(model, ids, 32, 32, sigma)
        got, nfe, _, _ = ours(model, tok, prompt, 32, 32, sigma)
        assert (got, nfe) == (want, forwards), prompt


@pytest.mark.parametrize("gen,block,args", [
    (32, 32, dict(current_k=4, rollout_p=0.1, sigma=10.0, inflate_w=0)),  # (c)
    (32, 8, dict(current_k=4, rollout_p=0.1, sigma=10.0, inflate_w=4)),  # (d): blocks, inflation, Dream's shift
    (32, 32, dict(current_k=32, rollout_p=0.3, sigma=10.0, inflate_w=0)),  # the authors' k, a wider nucleus
])
def test_d2cache_equals_the_transcription(tiny, gen, block, args):
    """Same tokens, same forwards, same rows computed at every forward."""
    model, tok = tiny
    for prompt in HARD:
        ids = encode_prompts(tok, [prompt], chat=True)[0]
        cache = ReferenceD2Cache(args["current_k"], args["rollout_p"], args["sigma"], args["inflate_w"])
        want = reference_generate(model, ids, gen, block, args["sigma"], cache)
        got, nfe, rows, _ = ours(model, tok, prompt, gen, block, args["sigma"], "d2cache", **args)
        assert (got, nfe, rows) == want, prompt
        assert rows[0] == len(ids) + gen and max(rows[1:]) < len(ids) + gen  # only the first forward is full


def test_confidences_stay_the_first_forwards_unless_refreshed():
    """Configuration (c)'s frozen C: after decoding, the cache still holds the first forward's greedy confidences;
    `refresh_confidence` updates them where a forward predicts a masked position, as the transcription with the
    authors' confidence write taking effect, and decodes differently here (add: its tokens)."""
    model, tok = dllm.load("tiny-llada")
    args = dict(current_k=4, rollout_p=0.1, sigma=10.0, inflate_w=0)
    ids = encode_prompts(tok, [PROMPTS[1]], chat=True)[0]
    _, _, _, policy = ours(model, tok, PROMPTS[1], 32, 32, 10.0, "d2cache", **args)
    canvas = torch.tensor([ids + [model.config.mask_id] * 32])
    with torch.no_grad():
        logits = model(canvas)[0, len(ids):]
    logits[:, model.config.mask_id] = -torch.inf
    kept = policy.kept.confidence[0, len(ids):]
    assert torch.allclose(kept, logits.softmax(-1).amax(-1), atol=1e-6)

    differ = 0
    for prompt in HARD:
        ids = encode_prompts(tok, [prompt], chat=True)[0]
        cache = ReferenceD2Cache(4, 0.1, 10.0, 0, update_confidence=True)
        want = reference_generate(model, ids, 32, 32, 10.0, cache)
        got = ours(model, tok, prompt, 32, 32, 10.0, "d2cache", refresh_confidence=True, **args)[:3]
        assert got == want, prompt
        differ += got != ours(model, tok, prompt, 32, 32, 10.0, "d2cache", **args)[:3]
    assert differ  # the flag changes what is decoded


def test_padded_rows_decode_as_alone_without_top_up(tiny):
    """Each row's rows come from its own confidences, density and rollout: with `top_up=False` a left-padded batch
    gives each prompt's tokens alone, forward for forward."""
    model, tok = tiny
    ids = encode_prompts(tok, PROMPTS, chat=True)
    assert len({len(i) for i in ids}) > 1
    args = dict(current_k=4, top_up=False)
    assert not caches.CACHES.create("d2cache", **args).rows_coupled
    sampler = samplers.SAMPLERS.create("certainty_prior")
    batch, stats, _ = decode(model, ids, sampler, caches.CACHES.create("d2cache", **args), 32, 32, stop_early=False)
    for row, prompt in enumerate(ids):
        alone, alone_stats, _ = decode(model, [prompt], sampler, caches.CACHES.create("d2cache", **args), 32, 32,
                                       stop_early=False)
        assert batch.tokens[row, batch.prompt_length:].tolist() == alone.tokens[0, alone.prompt_length:].tolist()
        assert alone_stats.nfe == stats.nfe


def test_top_up_gives_every_row_as_many_rows():
    """The authors' batching: every row of a batch computes as many rows at each forward (none padded), so the rows
    are coupled (`dllm serve` decodes such a request alone); without it the counts differ."""
    model, tok = dllm.load("tiny-llada")
    ids = encode_prompts(tok, PROMPTS, chat=True)
    for top_up in (True, False):
        policy = caches.CACHES.create("d2cache", current_k=4, top_up=top_up)
        assert policy.rows_coupled is top_up
        plans, plan = [], policy.plan
        policy.plan = lambda kv, request: plans.append(plan(kv, request)) or plans[-1]
        decode(model, ids, samplers.SAMPLERS.create("certainty_prior"), policy, 32, 32, stop_early=False)
        ragged = [not bool(rows.valid.all()) for rows in plans[1:]]
        assert not any(ragged) if top_up else any(ragged)


def test_what_cannot_decode_with_d2cache_is_refused():
    model, tok = dllm.load("tiny-llada")
    with pytest.raises(DllmError, match="cache 'd2cache' chooses a row's recomputed rows from the model's attention "
                                        "and predictions, which cfg_scale splits"):
        dllm.generate(model, tok, PROMPTS[:1], cache="d2cache", cfg_scale=1.0)
    with pytest.raises(DllmError, match="cache 'd2cache' chooses its rows token by token and runs eagerly"):
        dllm.generate(model, tok, PROMPTS[:1], cache="d2cache", compile=True)
    with pytest.raises(DllmError, match="sampler 'speculative' verifies drafts, which cache 'd2cache' cannot do"):
        dllm.generate(model, tok, PROMPTS[:1], sampler="speculative", cache="d2cache")
    with pytest.raises(DllmError, match="sampler 'prophet' reads the logits of decoded tokens, which cache "
                                        "'d2cache' does not compute"):
        dllm.generate(model, tok, PROMPTS[:1], sampler="prophet", answer_start=5, cache="d2cache")
    with pytest.raises(DllmError, match="sampler 'certainty_prior' parameter sigma=0.0 is out of range"):
        dllm.generate(model, tok, PROMPTS[:1], sampler="certainty_prior", sigma=0.0)
    sdar, sdar_tok = random_model("sdar-tiny"), dllm.load("random:sdar-tiny")[1]
    with pytest.raises(DllmError, match="cache 'd2cache' chooses rows for full attention"):
        dllm.generate(sdar, sdar_tok, PROMPTS[:1], cache="d2cache")


def test_d2cache_store_counts_its_bytes():
    """K/V of every layer, the rollout and the confidences; the attention probabilities of the computed rows are
    made per layer and not kept."""
    model, tok = dllm.load("tiny-dream")
    out = dllm.generate(model, tok, PROMPTS[:1], cache="d2cache", gen_length=32, block_length=32)
    cfg, length = model.config, len(encode_prompts(tok, PROMPTS[:1], chat=True)[0]) + 32
    kv = cfg.n_layers * 2 * length * cfg.n_kv_heads * cfg.head_dim * 4
    assert out.stats.cache_bytes == kv + (length * length + length) * 4
