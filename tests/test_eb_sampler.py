"""EB-Sampler (`samplers/eb_sampler.py`; arXiv 2505.24857, no official code) against plain transcriptions of the three
ports' loops, token for token and forward for forward (spec `strategies_2026.md`, fidelity configurations): NEUIR/
PC-Sampler's `generate_with_eb_sampler` (our defaults), omerlux/DUS's `generate_eb_sampler` (bits, semi-AR blocks) and
Kamichanw/d2Cache's `confidence_unmasking(gamma)` (ranked by confidence). The entropy bound is shared with SDAR's
`entropy_bounded` and DiffusionGemma's `entropy_bound`: they decode what they decoded before it was shared."""
import functools

import pytest
import torch
from conftest import random_model

import dllm
from dllm import cache as caches
from dllm import samplers
from dllm.engine import decode
from dllm.engine.text import encode_prompts
from dllm.samplers import entropy_bound as entropy_bound_module
from dllm.samplers.base import Commit, gumbel_argmax, per_row, token_probability, top_k_per_row

PROMPTS = ["reverse: abc12", "sort: 42,07,19,03", "add: 0457+0168", "copy: k3x9a"]


@functools.cache
def loaded(name: str):
    """The shipped tiny models (realistic confidences: a block often in one step) and random ones (entropies near
    log V: the bound admits more than one position a step only at large gamma)."""
    if name.startswith("tiny-"):
        return dllm.load(name)
    return random_model(name), dllm.load(f"random:{name}")[1]


TRAINED, RANDOM = ["tiny-llada", "tiny-dream"], ["llada-tiny", "dream-tiny"]


def canvas(model, prompt: list[int], gen_length: int) -> torch.Tensor:
    x = torch.full((1, len(prompt) + gen_length), model.config.mask_id)
    x[0, :len(prompt)] = torch.tensor(prompt)
    return x


def forward(model, x: torch.Tensor) -> torch.Tensor:
    """Every position's logits (Dream's aligned as the ports' harnesses align them). The one change to the ports:
    MASK's logit is -inf (the toolkit never proposes MASK, see `samplers.base`)."""
    logits = model(x)
    logits[..., model.config.mask_id] = float("-inf")
    return logits


def pc_sampler_eb(model, prompt, gamma, gen_length):
    """PC-Sampler `generate_with_eb_sampler` at temperature 0: the whole answer at once; while anything is masked,
    the masked positions' entropies (torch's Categorical, nats, the logits' dtype) sorted ascending, k = how many of
    cumsum - cummax are <= gamma, clamped to [1, masks], the first k committed with the argmax."""
    x, forwards = canvas(model, prompt, gen_length), 0
    mask_id = model.config.mask_id
    while (x == mask_id).any():
        masked = x == mask_id
        logits = forward(model, x)
        forwards += 1
        predicted = logits.argmax(-1)
        entropy = torch.distributions.Categorical(logits=logits[masked]).entropy()
        positions = masked.nonzero(as_tuple=True)[1]
        order = torch.argsort(entropy)
        ranked = entropy[order]
        k = int((ranked.cumsum(0) - ranked.cummax(0).values <= gamma).sum())
        chosen = positions[order][:min(max(k, 1), len(order))]
        x[0, chosen] = predicted[0, chosen]
    return x[0, len(prompt):].tolist(), forwards


def dus_eb(model, prompt, gamma, gen_length, block_length):
    """DUS `generate_eb_sampler` at temperature 0 with steps = gen_length: per block, at most steps / blocks
    forwards while the block has masks; the block's masked positions' entropies in bits (float64 softmax,
    -sum p log2(p + 1e-10)) sorted ascending, k = how many of cumsum - cummax are <= gamma, clamped to [1, masks]."""
    x, forwards, start = canvas(model, prompt, gen_length), 0, len(prompt)
    mask_id, blocks = model.config.mask_id, gen_length // block_length
    for b in range(blocks):
        lo, hi = start + b * block_length, start + (b + 1) * block_length
        for _ in range(gen_length // blocks):
            masked = x == mask_id
            if not masked[:, lo:hi].any():
                break
            logits = forward(model, x)
            forwards += 1
            predicted = logits.argmax(-1)
            p = logits.double().softmax(-1)
            entropy = -(p * torch.log2(p + 1e-10)).sum(-1)
            ranked, ids = torch.where(masked[0, lo:hi], entropy[0, lo:hi], float("inf")).sort()
            ranked, ids = ranked[ranked != float("inf")], ids[ranked != float("inf")]
            k = int((ranked.cumsum(0) - ranked.cummax(0).values <= gamma).sum())
            chosen = lo + ids[:max(1, min(k, len(ids)))]
            x[0, chosen] = predicted[0, chosen]
    return x[0, start:].tolist(), forwards


def d2cache_eb(model, prompt, gamma, gen_length, block_length):
    """d2Cache `vanilla_generate(alg="maskgit_plus", gamma=...)` at temperature 0, one row: per block, while it has
    masks, confidence = the float32 softmax's maximum on the block's masks (-inf elsewhere), the answer's positions
    sorted by it (descending) and their entropies (Categorical over the probabilities) taken in that order; the
    cummax over the batch axis of one row is the entropy itself, so k = how many of cumsum - entropy are <= gamma,
    clamped to [1, masks in the block]; the top-k by confidence committed."""
    x, forwards, start = canvas(model, prompt, gen_length), 0, len(prompt)
    mask_id = model.config.mask_id
    for b in range(gen_length // block_length):
        in_block = torch.zeros(gen_length, dtype=torch.bool)
        in_block[b * block_length:(b + 1) * block_length] = True
        while True:
            eligible = (x[0, start:] == mask_id) & in_block
            if not eligible.any():
                break
            logits = forward(model, x)[0, start:]
            forwards += 1
            probs = torch.softmax(logits, dim=-1)
            confidence, predicted = probs.max(dim=-1)
            confidence = torch.where(eligible, confidence, -torch.inf)
            _, ids = torch.sort(confidence, descending=True)
            entropy = torch.distributions.Categorical(probs=probs.float()).entropy()[ids]
            k = int((entropy.cumsum(0) - entropy <= gamma).sum())
            chosen = torch.topk(confidence, min(max(k, 1), int(eligible.sum()))).indices
            x[0, start + chosen] = predicted[chosen]
    return x[0, start:].tolist(), forwards


def ours(model, tok, prompt, gen_length, block_length, **params):
    out = dllm.generate(model, tok, [prompt], sampler="eb_sampler", gen_length=gen_length, block_length=block_length,
                        stop_early=False, chat=True, **params)
    return out.sequences[0, -gen_length:].tolist(), out.stats.nfe


def answers(name, port, gen_length, block_length, gamma, **params):
    model, tok = loaded(name)
    prompts = PROMPTS if name in TRAINED else PROMPTS[:2]  # a random model answers all alike
    want = [port(model, ids, gamma, gen_length, block_length) for ids in encode_prompts(tok, prompts, chat=True)]
    got = [ours(model, tok, prompt, gen_length, block_length, gamma=gamma, **params) for prompt in prompts]
    return got, want


@pytest.mark.parametrize("name,gamma", [(m, g) for m in TRAINED for g in (0.01, 1e9, 0.0)] +
                         [(m, g) for m in RANDOM for g in (8.0, 1e9)])
def test_the_defaults_are_pc_samplers_port(name, gamma):
    """(a) G 16, gamma 0.01; (b) gamma 1e9: one forward; (c) gamma 0; gamma 8: a few a step on random models."""
    got, want = answers(name, lambda m, ids, g, n, _: pc_sampler_eb(m, ids, g, n), 16, 16, gamma)
    assert got == want
    if gamma == 1e9:
        assert {n for _, n in want} == {1}


@pytest.mark.parametrize("name,gamma", [(m, 1.0) for m in TRAINED] + [(m, 12.0) for m in RANDOM])
def test_bits_in_blocks_is_dus_port(name, gamma):
    """(d) G 32, B 8, gamma 1.0 bits (12 bits on random models: several a step)."""
    got, want = answers(name, dus_eb, 32, 8, gamma, unit="bits")
    assert got == want


@pytest.mark.parametrize("name,gamma", [(m, 1.0) for m in TRAINED] + [(m, 8.0) for m in RANDOM])
def test_confidence_order_is_d2caches_port(name, gamma):
    """(d) the d2Cache ordering at the same gamma (its entropies are in nats), G 32, B 8 (gamma 8 on random models:
    one to three a step); there it commits other positions than the entropy order does."""
    got, want = answers(name, d2cache_eb, 32, 8, gamma, order="confidence")
    assert got == want
    if name in RANDOM:
        model, tok = loaded(name)
        assert got != [ours(model, tok, prompt, 32, 8, gamma=gamma) for prompt in PROMPTS[:2]]


ROWS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19], [20, 21]]
# (model, sampler, parameters): entropy_bounded: gen 32, blocks of 16, no cache, seeds 1-4; on sdar-tiny gen 16 in its
# blocks of 4 with the block cache; entropy_bound: gen 32, canvases of 16, 24 steps, seeds 3 and 8
SHARED_BOUND = [
    ("llada-tiny", "entropy_bounded", {"bound": 12.0}),
    ("llada-tiny", "entropy_bounded", {"bound": 8.0, "temperature": 0.9}),
    ("dream-tiny", "entropy_bounded", {"bound": 6.0}),
    ("dream-tiny", "entropy_bounded", {"bound": 12.0}),
    ("dream-tiny", "entropy_bounded", {"bound": 8.0, "temperature": 0.9}),
    ("sdar-tiny", "entropy_bounded", {"bound": 0.35}),
    ("sdar-tiny", "entropy_bounded", {"bound": 9.0}),
    ("diffusion-gemma-tiny", "entropy_bound", {"bound": 0.1}),
    ("diffusion-gemma-tiny", "entropy_bound", {"bound": 1.0}),
    ("diffusion-gemma-tiny", "entropy_bound", {"bound": 20.0}),
]


class EntropyBoundedBefore(samplers.SAMPLERS.get("entropy_bounded")):
    """SDAR's `entropy_bounded` as it was before the bound was shared (main at 340e613), the reference."""

    def step(self, ctx):
        tokens = gumbel_argmax(ctx.logits, self.temperature, ctx.generators)
        logp = ctx.logits.float().log_softmax(-1)
        entropy = -(logp.exp() * logp).nan_to_num().sum(-1)  # 0 * -inf counts 0
        ranked = entropy.masked_fill(~ctx.eligible, float("inf")).sort(dim=1).values
        count = (ranked.cumsum(1) < per_row(self.bound, ranked)).sum(1).clamp(min=1)
        return Commit(top_k_per_row(-entropy, ctx.eligible, count), tokens, token_probability(ctx.logits, tokens))


def low_entropy_keep_before(entropy, bound):
    """DiffusionGemma's `entropy_bound` kept samples as it chose them before the bound was shared (340e613)."""
    ranked, order = entropy.sort(dim=-1)
    kept = ranked.cumsum(-1) - ranked <= per_row(bound, ranked)
    return torch.zeros_like(kept).scatter(-1, order, kept)


def decoded(preset: str, sampler) -> tuple[list, int]:
    model = random_model(preset)
    if preset == "sdar-tiny":
        canvas, stats, _ = decode(model, ROWS[:2], sampler, caches.CACHES.create("block"), 16, 4)
    elif sampler.name == "entropy_bound":
        canvas, stats, _ = decode(model, ROWS[:2], sampler, caches.CACHES.create("none"), 32, 16, 24, seed=[3, 8])
    else:
        canvas, stats, _ = decode(model, ROWS, sampler, caches.CACHES.create("none"), 32, 16, seed=[1, 2, 3, 4],
                                  stop_early=False)
    return canvas.tokens.tolist(), stats.nfe


@pytest.mark.parametrize("preset,name,params", SHARED_BOUND, ids=lambda v: str(v) if isinstance(v, str) else
                         ",".join(f"{k}={x}" for k, x in v.items()))
def test_the_samplers_sharing_the_bound_decode_as_before(preset, name, params, monkeypatch):
    """Canvas and forwards equal to the rule's before the bound was shared, computed in this run (a hash recorded
    on one machine of a random model's sampled canvas fails on a CPU that rounds floats otherwise)."""
    now = decoded(preset, samplers.SAMPLERS.create(name, **params))
    if name == "entropy_bounded":
        before = decoded(preset, EntropyBoundedBefore(**params))
    else:
        monkeypatch.setattr(entropy_bound_module, "low_entropy_keep", low_entropy_keep_before)
        before = decoded(preset, samplers.SAMPLERS.create(name, **params))
    assert now == before


def test_the_shipped_models_decode_entropy_bounded_as_before():
    """tiny-llada, many positions a step, against the rule before the bound was shared, in this run."""
    model, tok = loaded("tiny-llada")
    settings = dict(gen_length=64, block_length=16, seed=[1, 2, 3, 4], stop_early=False)
    out = dllm.generate(model, tok, PROMPTS, sampler="entropy_bounded", bound=0.35, temperature=0.8, **settings)
    before = dllm.generate(model, tok, PROMPTS, sampler=EntropyBoundedBefore(bound=0.35, temperature=0.8), **settings)
    assert (out.token_ids, out.stats.nfe) == (before.token_ids, before.stats.nfe)
    assert out.stats.nfe < 16  # 4 blocks of 16: more than 4 positions a forward on average
