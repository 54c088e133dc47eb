"""KLASS (`samplers/klass.py`) against plain transcriptions of the authors' LLaDA `stable_confident_decode` and
Dream `_sample` (alg klass) at temperature 0 (the LLaDA temperature quirk exp(l) / g^T is not compared: the authors
draw from torch's global generator): the same tokens in the same number of forwards, on the shipped tiny models and
a random one; a padded row in a batch equals its prompt alone; the caches and flags."""
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from conftest import random_model

import dllm
from dllm import cache as caches
from dllm import samplers
from dllm.core.errors import DllmError
from dllm.engine import Batch, decode
from dllm.engine.text import encode_prompts

PROMPTS = ["reverse: abc12", "sort: 42,07,19,03", "add: 0457+0168", "copy: k3x9a"]


def kl_step(p, previous, history):
    """The authors' KL of this step's distributions from the last step's, rolled into the history (newest last)."""
    kl = (p * (torch.log(p + 1e-12) - torch.log(previous + 1e-12))).sum(-1)
    history = torch.roll(history, shifts=-1, dims=-1)
    history[..., -1] = kl
    return history


def reference_llada(model, prompt, gen_length, block_length, steps, tau, kappa, H, carry=True):
    """`stable_confident_decode` (alg klass, unmask_strategy all) at temperature 0 for one prompt, step by step:
    full forwards, float64 softmax over the whole sequence, the KL history and last distributions of every position
    kept across blocks (`carry=False`: reset at each block, not the authors', to show that the comparison sees the
    carry-over), ready = stable (from the block's step H - 1 on) and c > tau, else `topk` of the schedule's n_t.
    The one change: MASK's logit is -inf. Returns the answer, the forwards and which branch each step took."""
    mask = model.config.mask_id
    x = torch.tensor([prompt + [mask] * gen_length])
    per_block = steps // (gen_length // block_length)
    history = torch.zeros(1, x.shape[1], H, dtype=torch.float64)
    previous = torch.zeros(1, x.shape[1], model.config.vocab_size, dtype=torch.float64)
    forwards, branches = 0, Counter()
    for block in range(gen_length // block_length):
        start, end = len(prompt) + block * block_length, len(prompt) + (block + 1) * block_length
        masks = int((x[0, start:end] == mask).sum())
        schedule = [masks // per_block + (i < masks % per_block) for i in range(per_block)]
        if not carry:
            history.zero_()
            previous.zero_()
        for t in range(per_block):
            mask_index = torch.zeros_like(x, dtype=torch.bool)
            mask_index[:, start:end] = x[:, start:end] == mask
            if not mask_index.any():
                break
            logits = model(x)
            forwards += 1
            logits[..., mask] = float("-inf")
            p = F.softmax(logits.to(torch.float64), dim=-1)
            x0 = p.argmax(-1)
            conf = p.gather(-1, x0[..., None])[..., 0]
            history = kl_step(p, previous, history)
            previous = p.clone()
            stable = (history < kappa).all(-1) if t >= H - 1 else torch.zeros_like(mask_index)
            ready = stable & (conf > tau) & mask_index
            if ready[0].any():
                chosen = torch.where(ready[0])[0]
                branches["ready"] += 1
            else:
                conf[:, end:] = float("-inf")
                confidence = torch.where(mask_index, conf, float("-inf"))
                chosen = torch.topk(confidence[0], k=schedule[t]).indices
                branches["fallback"] += 1
            x[0, chosen] = x0[0, chosen]
    return x[0, len(prompt):].tolist(), forwards, branches


def top_p_logits(logits, top_p):
    """Dream's nucleus filter: drop the tokens after the first whose cumulative probability exceeds top_p."""
    ordered, order = logits.sort(descending=True)
    drop = F.softmax(ordered, dim=-1).cumsum(-1) > top_p
    drop[..., 1:] = drop[..., :-1].clone()
    drop[..., 0] = False
    return logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), torch.finfo(logits.dtype).min)


def reference_dream(model, prompt, gen_length, steps, tau, kappa, H, top_p=None):
    """Dream's `_sample` with alg klass (unmask_strategy all) at temperature 0 for one prompt: one block, the
    argmax of the masked positions' softmax (the logits' dtype), c and KL from the float64 softmax of the whole
    sequence, no gate; ready = stable and c >= tau, else one position: the highest `sample_tokens` confidence
    (top_p applied) among the masks, committed with the argmax. The one change: MASK's logit is -inf."""
    mask = model.config.mask_id
    x = torch.tensor([prompt + [mask] * gen_length])
    history = torch.zeros(1, x.shape[1], H, dtype=torch.float64)
    previous = torch.zeros(1, x.shape[1], model.config.vocab_size, dtype=torch.float64)
    forwards, branches = 0, Counter()
    for _ in range(steps):
        mask_index = x == mask
        if mask_index.sum() == 0:
            break
        logits = model(x)  # Dream's shift applied: logits[:, i] scores token i
        forwards += 1
        logits[..., mask] = float("-inf")
        mask_logits = logits[mask_index]
        x0 = torch.zeros_like(x)
        x0[mask_index] = F.softmax(mask_logits, dim=-1).to(torch.float64).argmax(-1)
        p = F.softmax(logits.to(torch.float64), dim=-1)
        conf = p.gather(-1, x0[..., None])[..., 0]
        history = kl_step(p, previous, history)
        previous = p.clone()
        ready = (history < kappa).all(-1) & (conf >= tau) & mask_index
        if ready.any():
            transfer = ready
            branches["ready"] += 1
        else:
            fallback = mask_logits if top_p is None else top_p_logits(mask_logits, top_p)
            chosen = F.softmax(fallback, dim=-1).max(-1).values.argmax()
            transfer = torch.zeros_like(mask_index)
            transfer[0, torch.where(mask_index[0])[0][chosen]] = True
            branches["fallback"] += 1
        x[transfer] = x0[transfer]
    return x[0, len(prompt):].tolist(), forwards, branches


def ours(model, tok, prompts, gen_length, block_length, steps, cache=None, **args):
    out = dllm.generate(model, tok, prompts, sampler="klass", cache=cache, gen_length=gen_length,
                        block_length=block_length, steps=steps, chat=True, stop_early=False, **args)
    return out.sequences[:, out.sequences.shape[1] - gen_length:].tolist(), out.stats.nfe


LLADA_CONFIGS = {  # the spec's fidelity configurations (a)-(c), and the authors' GSM8K setting of tau and kappa
    "a": dict(gen_length=16, block_length=8, steps=16, tau=0.9, kappa=0.01, H=2),
    "b": dict(gen_length=16, block_length=8, steps=16, tau=0.0, kappa=1e9, H=2),
    "c": dict(gen_length=16, block_length=4, steps=16, tau=0.9, kappa=0.01, H=3),
    "gsm8k": dict(gen_length=32, block_length=16, steps=32, tau=0.6, kappa=0.015, H=2),
}


@pytest.mark.parametrize("config", list(LLADA_CONFIGS))
def test_llada_klass_is_the_authors_stable_confident_decode(tiny_llada, config):
    model, tok = tiny_llada
    c = LLADA_CONFIGS[config]
    seen = Counter()
    for ids, prompt in zip(encode_prompts(tok, PROMPTS, chat=True), PROMPTS):
        want, forwards, branches = reference_llada(model, ids, **c)
        got, nfe = ours(model, tok, [prompt], c["gen_length"], c["block_length"], c["steps"], threshold=c["tau"],
                        kl_threshold=c["kappa"], history_length=c["H"])
        assert (got[0], nfe) == (want, forwards), prompt
        seen += branches
    assert seen["ready"] and seen["fallback"]  # both branches decide
    if config == "b":  # all stable once the gate opens: a fallback step, then the rest of the block
        assert seen["ready"] == seen["fallback"] == len(PROMPTS) * 2


def test_the_comparison_sees_the_distributions_carried_across_blocks(tiny_llada):
    """Reset at every block, the authors' decoding would give other tokens or forwards: configuration (a)'s
    comparison above covers the carry-over."""
    model, tok = tiny_llada
    c = LLADA_CONFIGS["a"]
    runs = [[reference_llada(model, ids, **c, carry=carry)[:2] for ids in encode_prompts(tok, PROMPTS, chat=True)]
            for carry in (True, False)]
    assert runs[0] != runs[1]


def test_llada_klass_on_a_random_model(tiny_llada):
    """A random model's near-uniform predictions: low thresholds make both branches decide. With two positions a
    step (steps = gen_length / 2) a ready step may commit one where the schedule says two: the authors' block then
    ends with a mask left for good, where ours commits every mask left at the block's last step (the one
    difference); the other runs agree."""
    model, tok = random_model("llada-tiny"), tiny_llada[1]
    seen, left = Counter(), 0
    for ids, prompt in zip(encode_prompts(tok, PROMPTS, chat=True), PROMPTS):
        for steps in (16, 8):
            want, forwards, branches = reference_llada(model, ids, 16, 8, steps, tau=0.02, kappa=0.05, H=2)
            got, nfe = ours(model, tok, [prompt], 16, 8, steps, threshold=0.02, kl_threshold=0.05)
            assert nfe == forwards
            if model.config.mask_id in want:
                left += 1
                assert model.config.mask_id not in got[0]
                continue
            assert got[0] == want, (prompt, steps)
            seen += branches
    assert seen["ready"] and seen["fallback"] and 0 < left < len(PROMPTS)


DREAM_CONFIGS = {  # the spec's (d), the authors' defaults and their GSM8K setting, and top_p on the fallback
    "d": dict(tau=0.0, kappa=1e9, H=2),
    "defaults": dict(tau=0.9, kappa=0.01, H=2),
    "gsm8k": dict(tau=0.9, kappa=0.001, H=2),
    "top_p": dict(tau=0.9, kappa=0.001, H=3, top_p=0.5),
}


@pytest.mark.parametrize("config", list(DREAM_CONFIGS))
def test_dream_klass_is_the_authors_sample(tiny_dream, config):
    model, tok = tiny_dream
    c = DREAM_CONFIGS[config]
    seen = Counter()
    for ids, prompt in zip(encode_prompts(tok, PROMPTS, chat=True), PROMPTS):
        want, forwards, branches = reference_dream(model, ids, 16, 16, **c)
        got, nfe = ours(model, tok, [prompt], 16, 16, 16, threshold=c["tau"], kl_threshold=c["kappa"],
                        history_length=c["H"], top_p=c.get("top_p"))
        assert (got[0], nfe) == (want, forwards), prompt
        seen += branches
    if config == "d":  # no gate: everything is stable and ready at the first step
        assert seen == {"ready": len(PROMPTS)}
    else:
        assert seen["ready"] and seen["fallback"]


def test_dream_fallback_by_top_p_differs_from_plain(tiny_dream):
    """top_p changes which position the fallback commits (the truncated distribution's largest probability), so
    the top_p comparison above is one."""
    model, tok = tiny_dream
    c = {k: v for k, v in DREAM_CONFIGS["top_p"].items() if k != "top_p"}
    ids = encode_prompts(tok, PROMPTS, chat=True)
    assert [reference_dream(model, p, 16, 16, **c)[:2] for p in ids] != \
        [reference_dream(model, p, 16, 16, **c, top_p=0.5)[:2] for p in ids]


@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream"])
def test_a_padded_row_is_its_prompt_alone(tiny_llada, tiny_dream, name):
    """Rows of one batch take different numbers of steps per block; a row waiting for the others keeps its own
    distributions and history (its zero logits never enter them)."""
    model, tok = tiny_llada if name == "tiny-llada" else tiny_dream
    args = dict(gen_length=32, block_length=8 if name == "tiny-llada" else 32, steps=32, threshold=0.6,
                kl_threshold=0.015, seed=[0, 1, 2, 3])
    batch, nfe = ours(model, tok, PROMPTS, **args)
    alone = [ours(model, tok, [p], **{**args, "seed": [s]}) for s, p in enumerate(PROMPTS)]
    assert batch == [a[0][0] for a in alone]
    assert len({a[1] for a in alone}) > 1 and nfe >= max(a[1] for a in alone)  # rows waited for others


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_rows_sampled_with_their_own_generators(tiny_llada, tiny_dream, temperature):
    """At temperature > 0 (LLaDA's exp(l) / g^T, Dream's drawn fallback position) each row draws from its own
    generator: two copies of a prompt in one batch agree with it alone."""
    for model, tok in (tiny_llada, tiny_dream):
        args = dict(gen_length=16, block_length=16, steps=16, temperature=temperature, threshold=0.99,
                    kl_threshold=1e-4)
        batch, _ = ours(model, tok, [PROMPTS[2], PROMPTS[0], PROMPTS[2]], **args, seed=[5, 0, 5])
        alone, _ = ours(model, tok, [PROMPTS[2]], **args, seed=5)
        assert batch[0] == batch[2] == alone[0]


@pytest.mark.parametrize("cache", ["prefix", "dual", "dkv"])
def test_caches_refreshed_every_step_are_no_cache(tiny_llada, cache):
    """The positions after the block get logits under every cache that KLASS runs with (prefix and dual compute
    them, dkv every masked row), so refreshed every step each decodes what no cache does."""
    model, tok = tiny_llada
    args = dict(gen_length=32, block_length=8, steps=32, threshold=0.6, kl_threshold=0.015)
    assert ours(model, tok, PROMPTS, cache=cache, cache_args={"refresh_every": 1}, **args) == \
        ours(model, tok, PROMPTS, **args)


def test_what_cannot_work_is_refused(tiny_llada):
    model, tok = tiny_llada
    with pytest.raises(DllmError, match="cache 'dkv_greedy' needs a sampler whose next commits are known"):
        dllm.generate(model, tok, PROMPTS, sampler="klass", cache="dkv_greedy")
    with pytest.raises(DllmError, match=r"^sampler 'klass' cannot decode llada: top_p picks the fallback position of "
                                        r"Dream's KLASS; .*drop top_p$"):
        dllm.generate(model, tok, PROMPTS, sampler="klass", top_p=0.9)
    with pytest.raises(DllmError, match="orders by its own score"):
        dllm.generate(model, tok, PROMPTS, sampler="klass", confidence_eos_eot_inf=True)
    for name, kind in (("tiny-sdar", "block-causal"), ("random:nemotron-diffusion-tiny", "causal-prefix")):
        with pytest.raises(DllmError, match=rf"^sampler 'klass' cannot decode \w+: it carries every later position's "
                                            rf"prediction into the next block, and a {kind} model predicts a block "
                                            rf"only from finished blocks; use another sampler$"):
            dllm.generate(*dllm.load(name), PROMPTS, sampler="klass")
    batch = Batch(model, samplers.SAMPLERS.create("klass"), caches.CACHES.create("none"), 8, 8)
    assert not batch.joins_between_blocks  # the distributions outlive the block: a batch runs to its end
    batch.add(encode_prompts(tok, PROMPTS[:1], chat=True)[0], 16)
    batch.run_block()
    with pytest.raises(DllmError, match="cannot take rows into a running batch"):
        batch.add(encode_prompts(tok, PROMPTS[1:2], chat=True)[0], 16)


def test_llada_rows_with_their_own_settings_equal_each_alone():
    """Per-row thresholds, history lengths (a history as deep as the largest; each row's gate and stability from
    its own last H steps) and temperatures on LLaDA (tests/test_row_params.py checks Dream's, top_p included)."""
    model = random_model("llada-tiny")
    prompts = [[5, 6, 7, 8, 9], [12, 13, 14], [15, 16, 17, 18, 19, 20]]
    settings = [dict(history_length=1), dict(history_length=3, threshold=0.03, temperature=0.5),
                dict(kl_threshold=0.02)]
    rows = [samplers.SAMPLERS.create("klass", **{"threshold": 0.02, "kl_threshold": 0.05, **s}) for s in settings]

    def answers(pairs):
        batch = Batch(model, pairs[0][1], caches.CACHES.create("none"), 8, 8)
        added = [batch.add(p, 16, seed=3, sampler=s) for p, s in pairs]
        while batch.running:
            batch.run_block()
        return [batch.answer(r) for r in added]
    alone = [answers([pair])[0] for pair in zip(prompts, rows)]
    assert answers(list(zip(prompts, rows))) == alone
    assert alone != [answers([(p, rows[0])])[0] for p in prompts]  # the settings decide


def test_dream_rows_with_their_own_top_p_equal_each_alone(tiny_dream):
    """top_p per row (None in some rows) on tiny-dream, where it moves the fallback position."""
    model, tok = tiny_dream
    ids = encode_prompts(tok, PROMPTS, chat=True)
    rows = [samplers.SAMPLERS.create("klass", history_length=3, top_p=p) for p in (None, 0.5, 0.5, None)]

    def answers(pairs):
        batch = Batch(model, pairs[0][1], caches.CACHES.create("none"), 16, 16)
        added = [batch.add(p, 16, sampler=s) for p, s in pairs]
        while batch.running:
            batch.run_block()
        return [batch.answer(r) for r in added]
    alone = [answers([pair])[0] for pair in zip(ids, rows)]
    assert answers(list(zip(ids, rows))) == alone
    assert alone != [answers([(p, rows[0])])[0] for p in ids]
