"""WINO (arXiv 2507.18578) against a plain transcription of the authors' `decoding_wino` (Feng-Hong/WINO-DLLM
`LLaDA/decoding.py`): same tokens and same forwards in the spec's fidelity configurations; its caches, batches and
refusals."""
import pytest
import torch
from conftest import random_model

from dllm import cache as caches
from dllm import samplers
from dllm.core.errors import DllmError
from dllm.engine import decode
from dllm.engine.decoding import decoded
from dllm.engine.text import encode_prompts

TEXTS = ["reverse: abc12", "sort: 42,07,19,03", "add: 0457+0168", "copy: k3x9a"]
IDS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]


@pytest.fixture(scope="module")
def tiny(tiny_llada):
    model, tok = tiny_llada
    return model, encode_prompts(tok, TEXTS, chat=True)


@pytest.fixture(scope="module")
def rand():
    return random_model("llada-tiny")


def reference_wino(model, prompt, gen_length, block_length, tau_in, tau_out, rule="official"):
    """`decoding_wino` at temperature 0, batch 1, one step at a time: the canvas `[prompt | gen]` with a shadow block
    of B masks after it; one forward of all P + G + B rows per step, position ids 0..P+G-1 then the block's, and a
    boolean mask where every row sees every canvas column, no canvas row sees a shadow row, the shadow rows see each
    other and shadow row j does not see the block's column j. Per step: cap = min(max(int(0.7 |masked|), 5), 20) from
    the masks before it; argmax guesses (a shadow row's guess is its twin's current token) and their float64
    probabilities; commit the masked block positions strictly above tau_in (more than cap: the cap most probable;
    none: the most probable one); if more than one was committed, re-mask the tokens decoded before the step whose
    shadow probability is strictly below tau_out, the lowest last_accept - 1 of them if there are last_accept or more
    (last_accept: the previous step's commits, 30 before the block's first step). A block ends when it has no mask.
    rule="d2cache" (Kamichanw/d2Cache `wino.py`): at least tau_in, and the re-masks capped by this step's commits - 1.
    The one change: MASK's logit is -inf (the toolkit never proposes MASK, see `samplers.base`). Returns the answer,
    the forwards and the re-masks."""
    mask = model.config.mask_id
    p, g, b = len(prompt), gen_length, block_length
    x = torch.tensor([*prompt] + [mask] * (g + b))
    nfe = remasks = 0
    for block in range(g // b):
        s = p + block * b
        positions = torch.cat((torch.arange(p + g), torch.arange(s, s + b)))
        sees = torch.ones(p + g + b, p + g + b, dtype=torch.bool)
        sees[:, p + g:] = False
        sees[p + g:, p + g:] = True
        for j in range(b):
            sees[p + g + j, s + j] = False
        masked = {i for i in range(s, s + b) if x[i] == mask}
        decoded = set(range(s, s + b)) - masked
        last_accept = 30
        while masked:
            cap = min(max(int(torch.tensor(len(masked)) * 0.7), 5), 20)
            logits = model.run(x[None], positions[None], sees[None, None])[0]
            logits[:, mask] = float("-inf")
            nfe += 1
            probs = logits.double().softmax(-1)
            guess = logits.argmax(-1)
            confidence = {i: probs[i, guess[i]].item() for i in masked}
            shadow = {i: probs[p + g + i - s, x[i]].item() for i in decoded}
            above = [i for i in sorted(masked) if (confidence[i] > tau_in if rule == "official" else
                                                   confidence[i] >= tau_in)]
            ranked = sorted(sorted(masked), key=lambda i: -confidence[i])  # torch.topk; ties: the lowest position
            chosen = ranked[:cap] if len(above) > cap else above or ranked[:1]
            low = [i for i in sorted(decoded) if shadow[i] < tau_out]
            most = (last_accept if rule == "official" else len(chosen)) - 1
            again = [] if len(chosen) < 2 else sorted(low, key=lambda i: shadow[i])[:max(most, 0)] if len(low) > most \
                else low
            for i in chosen:
                x[i] = guess[i]
            for i in again:
                x[i] = mask
            masked, decoded = (masked - set(chosen)) | set(again), (decoded | set(chosen)) - set(again)
            last_accept, remasks = len(chosen), remasks + len(again)
    return x[p:p + g].tolist(), nfe, remasks


def ours(model, prompt, gen_length, block_length, cache="none", **params):
    canvas, stats, _ = decode(model, [prompt], samplers.SAMPLERS.create("wino", **params), caches.CACHES.create(cache),
                              gen_length, block_length, stop_early=False)
    return canvas.tokens[0, len(prompt):].tolist(), stats


CONFIGS = {  # spec "Fidelity configurations": (gen, block, tau_in, tau_out, rule)
    "a_fallback": (16, 8, 0.6, 0.9, "official"),
    "b_capped": (32, 16, 0.0, 1.0, "official"),
    "c_never_remask": (16, 16, 0.05, 0.0, "official"),
    "d_d2cache": (32, 16, 0.0, 1.0, "d2cache"),
}


@pytest.mark.parametrize("config", CONFIGS)
def test_random_model_is_decoding_wino_token_for_token_and_forward_for_forward(rand, config):
    gen, block, tau_in, tau_out, rule = CONFIGS[config]
    for prompt in IDS:
        want, nfe, remasks = reference_wino(rand, prompt, gen, block, tau_in, tau_out, rule)
        got, stats = ours(rand, prompt, gen, block, threshold=tau_in, remask_threshold=tau_out, rule=rule)
        assert got == want and stats.nfe == nfe
        assert stats.gen_tokens == gen  # commits less re-masks
        if config == "a_fallback":  # nothing clears 0.6 on a random model: one token per step, never re-masked
            assert nfe == gen and remasks == 0
        if config == "c_never_remask":  # capped threshold decoding: the cap (11, then 5) bounds the forwards
            assert remasks == 0 and nfe == 2
        if config in ("b_capped", "d_d2cache"):
            assert remasks > 0
    if config == "d_d2cache":  # the two rules part on this configuration
        assert [reference_wino(rand, p, 32, 16, 0.0, 1.0)[1:] for p in IDS] != \
            [reference_wino(rand, p, 32, 16, 0.0, 1.0, "d2cache")[1:] for p in IDS]


@pytest.mark.parametrize("tau_in,tau_out", [(0.7, 0.9), (0.6, 0.9), (0.2, 0.9999)])
def test_tiny_llada_is_decoding_wino_token_for_token_and_forward_for_forward(tiny, tau_in, tau_out):
    model, prompts = tiny
    remasks = 0
    for prompt in prompts:
        want, nfe, n = reference_wino(model, prompt, 32, 16, tau_in, tau_out)
        got, stats = ours(model, prompt, 32, 16, threshold=tau_in, remask_threshold=tau_out)
        assert got == want and stats.nfe == nfe
        remasks += n
    if tau_out == 0.9999:
        assert remasks > 0  # narrow-out fires on the trained model (confident: only at this tau_out)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_a_cache_refreshed_every_step_is_no_cache(rand, cache):
    """The shadow rows read the store's keys and values: refreshed at every step, it holds what no cache computes."""
    for prompt in IDS:
        args = dict(threshold=0.0, remask_threshold=1.0)
        want, plain = ours(rand, prompt, 32, 16, **args)
        canvas, stats, _ = decode(rand, [prompt], samplers.SAMPLERS.create("wino", **args),
                                  caches.CACHES.create(cache, refresh_every=1), 32, 16, stop_early=False)
        assert canvas.tokens[0, len(prompt):].tolist() == want and stats.nfe == plain.nfe


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_padded_rows_are_their_prompts_alone(tiny, cache):
    model, prompts = tiny
    sampler = samplers.SAMPLERS.create("wino", threshold=0.2, remask_threshold=0.9999)
    batch, stats, _ = decode(model, prompts, sampler, caches.CACHES.create(cache), 32, 16, stop_early=False)
    for row, prompt in enumerate(prompts):
        alone, _, _ = decode(model, [prompt], sampler, caches.CACHES.create(cache), 32, 16, stop_early=False)
        assert batch.tokens[row, batch.prompt_length:].tolist() == alone.tokens[0, alone.prompt_length:].tolist()
    assert stats.gen_tokens == 32 * len(prompts)


def test_stopped_rows_and_logprobs_of_remasked_tokens(tiny):
    """Stopping early, each row ends at its first stop token, and a re-masked position reports the log-probability
    of the token committed there last (at the step that committed it again)."""
    model, prompts = tiny
    sampler = samplers.SAMPLERS.create("wino", threshold=0.2, remask_threshold=0.9999)
    batch = decoded(model, prompts, sampler, caches.CACHES.create("none"), 32, 16, trace=True,
                                logprobs=1)
    alone = [decoded(model, [p], sampler, caches.CACHES.create("none"), 32, 16) for p in prompts]
    assert any(step["edits"][b] for step in batch.trace for b in range(len(prompts)))  # re-masks happened
    for row, other in zip(batch.rows, alone):
        assert batch.answer(row) == other.answer(other.rows[0])
        for token in batch.logprobs(row):
            assert token.logprob == pytest.approx(token.top[0][1], abs=1e-6)  # greedy: the best of its step


def test_refusals(rand):
    with pytest.raises(DllmError, match=r"^sampler 'wino' cannot decode dream: WINO's shadow row must predict"):
        decode(random_model("dream-tiny"), IDS, samplers.SAMPLERS.create("wino"), caches.CACHES.create("none"), 16, 8)
    for cache in ("dkv", "elastic"):
        with pytest.raises(DllmError, match=rf"^sampler 'wino' computes extra rows beside the canvas rows, which cache "
                                            rf"'{cache}' \(rows chosen token by token\) cannot serve; use cache none"):
            decode(rand, IDS, samplers.SAMPLERS.create("wino"), caches.CACHES.create(cache), 16, 8)
