"""Likelihoods (LLaDA's Monte Carlo ELBO) and the lm-eval adapter's requests, without lm-eval installed."""
import dataclasses
import io
import math
from contextlib import redirect_stderr
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import random_model

import dllm
from dllm.core.errors import DllmError
from dllm.engine.likelihood import elbo, is_greedy
from dllm.models import DiffusionLM
from dllm.eval.lm_eval_model import DllmLM


def exact_elbo(model, prefix: list[int], target: list[int]) -> float:
    """The ELBO by enumerating every mask pattern: pattern S of l masked tokens has probability
    (1/L) / C(L, l) and weight L / l (2^L - 1 forwards)."""
    n, length = len(prefix), len(target)
    sequence = torch.tensor(prefix + target)
    window = (n, n + length) if model.config.causal_prefix else None  # the continuation is the block decoded
    total = 0.0
    with torch.no_grad():
        for pattern in range(1, 2 ** length):
            masked = torch.tensor([False] * n + [bool(pattern >> i & 1) for i in range(length)])
            count = int(masked.sum())
            noisy = torch.where(masked, model.config.mask_id, sequence)[None]
            logp = model(noisy, window=window)[0].float().log_softmax(-1)
            term = float(logp[masked].gather(1, sequence[masked][:, None]).sum())
            total += term * (length / count) / length / math.comb(length, count)
    return total


@pytest.fixture(scope="module")
def tiny_llada():
    return dllm.load("tiny-llada")


@pytest.mark.parametrize("which", ["tiny-llada", "dream-tiny", "nemotron-diffusion-tiny"])
def test_monte_carlo_elbo_matches_every_mask_pattern_enumerated(which, tiny_llada):
    """A 3-token continuation: 7 mask patterns, each weighted (1/L) (L/l) / C(L, l); the estimate (4096 draws)
    lands within 4 of its standard deviations (measured: 0.15 tiny-llada, 0.008 dream-tiny at 4096). Nemotron's
    context is causal, its continuation bidirectional (and differs from the all-bidirectional bound)."""
    model = tiny_llada[0] if which == "tiny-llada" else random_model(which, std=0.05)
    prefix, target = [7, 8, 9, 10, 11], ([28, 29, 30] if which == "tiny-llada" else [12, 13, 14])
    exact = exact_elbo(model, prefix, target)
    estimate = elbo(model, prefix, target, mc_num=4096, batch_size=512, convention="llada")
    assert abs(estimate - exact) < (0.6 if which == "tiny-llada" else 0.04), (estimate, exact)
    if model.config.causal_prefix:  # the mask took effect: a bidirectional context gives another bound
        other = DiffusionLM(dataclasses.replace(model.config, causal_prefix=False))
        other.load_state_dict(model.state_dict())
        assert abs(exact_elbo(other.eval(), prefix, target) - exact) > 1e-3


def test_elbo_is_deterministic_for_a_seed(tiny_llada):
    model = tiny_llada[0]
    one, again = (elbo(model, [7, 8, 9], [28, 29], mc_num=64, batch_size=16, seed=3) for _ in range(2))
    other = elbo(model, [7, 8, 9], [28, 29], mc_num=64, batch_size=16, seed=4)
    assert one == again != other


def test_elbo_refuses_an_empty_continuation(tiny_llada):
    with pytest.raises(DllmError, match="the continuation is empty"):
        elbo(tiny_llada[0], [7, 8], [])


@pytest.mark.parametrize("args,match", [
    (dict(target=[10**6]), r"the continuation must be a list of token ids in \[0, "),
    (dict(prefix=[-1]), "the context must be a list of token ids"),
    (dict(seed=2**70), "seed must be at most"),
    (dict(cfg_scale=float("nan")), "cfg_scale must be a number >= 0"),
    (dict(prefix=[], target=[5] * 600), "the continuation alone is too long; split it"),
])
def test_elbo_refuses_what_it_cannot_score(tiny_llada, args, match):
    args = {"prefix": [7, 8], "target": [9], "mc_num": 2, **args}
    with pytest.raises(DllmError, match=match):
        elbo(tiny_llada[0], args.pop("prefix"), args.pop("target"), **args)


def test_likelihood_requests_on_a_block_causal_model_and_unknown_characters():
    """tiny-sdar decodes its greedy check in its attention blocks; a character the tokenizer does not know is an
    error naming it, never read as end of text (tiny-llada's unk)."""
    from types import SimpleNamespace
    lm = _lm(model="tiny-sdar", mc_num=4)
    (score, greedy), = lm.loglikelihood([SimpleNamespace(args=("reverse: abc12\n", "#### 21cba"))], disable_tqdm=True)
    assert score < 0 and isinstance(greedy, bool)
    lm = _lm(model="tiny-llada", mc_num=4, greedy_check="off")
    assert lm.greedy_check is False
    with pytest.raises(DllmError, match="a request has characters the tokenizer does not know: 'A'"):
        lm.loglikelihood([SimpleNamespace(args=("copy: ab\n", "ABC"))], disable_tqdm=True)
    with pytest.raises(DllmError, match="leaves no room for a context"):
        _lm(model="tiny-llada", gen_length=256).generate_until([SimpleNamespace(args=("copy: ab", {}))])


def test_a_block_causal_bound_goes_block_by_block():
    """tiny-sdar's own greedy answer: each block scored with the blocks before it clean (as the model decodes)
    has a bound near 0 nats; masking across blocks at once (the model never sees that) gave about -26."""
    model, tok = dllm.load("tiny-sdar")
    out = dllm.generate(model, tok, ["reverse: abc12"])
    target, sequence = out.token_ids[0], out.sequences[0].tolist()
    n = next(i for i in range(len(sequence)) if sequence[i:i + len(target)] == target)
    prefix = sequence[:n]
    assert elbo(model, prefix, target, mc_num=32) > -0.5 and is_greedy(model, prefix, target)
    cut = -(-(n + 1) // 4) * 4 - n  # the end of the first attention block of the answer
    assert elbo(model, prefix, target, mc_num=32) == pytest.approx(
        elbo(model, prefix, target[:cut], mc_num=32) + elbo(model, prefix + target[:cut], target[cut:], mc_num=32))


def test_lm_eval_pairs_move_the_contexts_trailing_spaces_to_the_continuation():
    """lm-eval's TemplateLM._encode_pair: 'copy: ab ' + 'cd' is scored as 'copy: ab' + ' cd'."""
    lm = _lm(model="tiny-llada", mc_num=4)
    prefix, target = lm._encode_pair("copy: ab ", "cd")
    assert lm.tokenizer.decode(prefix) == "copy: ab" and lm.tokenizer.decode(target) == " cd"
    sdar = _lm(model="tiny-sdar", mc_num=4)  # a context that fills the model leaves room for whole blocks
    prefix, target = sdar._encode_pair("copy: " + "ab" * 200, "#### x")
    from types import SimpleNamespace
    assert len(prefix) + len(target) == sdar.model.config.max_length - 8
    (score, greedy), = sdar.loglikelihood([SimpleNamespace(args=("copy: " + "ab" * 200, "#### x"))],
                                           disable_tqdm=True)
    assert score < 0 and greedy is False


def test_the_checkpoint_is_pretrained_or_model_and_cfg_is_cfg_scale():
    """lm-eval's HF convention names the checkpoint `pretrained=`; `model=` stays; LLaDA's `cfg` is `cfg_scale`,
    which also guides the greedy check now that decoding takes it."""
    lm = _lm(pretrained="tiny-llada", mc_num=4, cfg=0.5)
    assert lm.model.config.arch == "llada" and lm.likelihood["cfg_scale"] == 0.5 == lm.decoding["cfg_scale"]
    request = SimpleNamespace(args=("copy: ab\n", "#### ab"))
    assert lm.loglikelihood([request], disable_tqdm=True)[0][0] < 0
    assert _lm(model="tiny-llada", pretrained="tiny-llada").model.config.arch == "llada"
    with pytest.raises(DllmError, match="name two checkpoints; give one"):
        _lm(model="tiny-llada", pretrained="tiny-dream")
    with pytest.raises(DllmError, match="disagree; give one"):
        _lm(model="tiny-llada", cfg=1.0, cfg_scale=2.0)
    with pytest.raises(DllmError, match="likelihood_convention must be one of llada, dream"):
        _lm(model="tiny-llada", likelihood_convention="ar")


def dream_reference_nll(model, tokenizer, context: str, continuation: str, mc_num: int, batch_size: int,
                        generator) -> float:
    """DreamLM/Dream `eval/eval.py` with add_bos_token=true, log_type 'ftb', nll_type 'mc', step by step:
    `_encode_pair` (BOS text before the context, its trailing spaces moved to the continuation, EOS id after the
    whole), then `_eval_target_nll_mc`: per batch one uniform u0, t = (u0 + i / b) % 1, p_mask = (1 - eps) t + eps,
    each position masked when a uniform falls below it, the first and last never; only the target noised; the
    loss of each masked token over its p_mask, summed over the batch / b; the mean over the batches. The random
    numbers come from `generator` in the order the reference draws them from torch's."""
    context = tokenizer.bos_token + context
    spaces = len(context) - len(context.rstrip())
    if spaces > 0:
        continuation, context = context[-spaces:] + continuation, context[:-spaces]
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    prefix_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    prefix, target = torch.tensor(prefix_ids), torch.tensor(whole[len(prefix_ids):])
    seq = torch.cat([prefix, target])[None, :].repeat(batch_size, 1)
    losses = []
    for _ in range(max(mc_num // batch_size, 1)):
        b, length = seq.shape
        u0 = torch.rand(1, generator=generator, dtype=torch.float32)
        t = (u0 + torch.arange(b).float() / b) % 1
        p_mask = ((1 - 1e-3) * t + 1e-3)[:, None].repeat(1, length)
        mask_indices = torch.rand((b, length), generator=generator) < p_mask
        mask_indices[:, 0] = False
        mask_indices[:, -1] = False
        noisy = torch.where(mask_indices, model.config.mask_id, seq)
        perturbed = seq.clone()
        perturbed[:, -len(target):] = noisy[:, -len(target):]
        masked = perturbed == model.config.mask_id
        logits = model(perturbed)  # aligned: our forward applies Dream's shift
        loss = F.cross_entropy(logits[masked], seq[masked], reduction="none") / p_mask[masked]
        losses.append((loss.sum() / batch_size).item())
    return sum(losses) / len(losses)


def test_a_dream_model_is_scored_as_dreams_harness_scores_it():
    """The lm-eval adapter on tiny-dream equals the transcription of Dream's harness draw for draw; LLaDA's
    convention (no BOS, no EOS, its estimator) gives another number."""
    lm = _lm(model="tiny-dream", mc_num=64, mc_batch_size=16, greedy_check=False, seed=5)
    context, continuation = "reverse: k3x9 ", "#### 9x3k"
    (score, _), = lm.loglikelihood([SimpleNamespace(args=(context, continuation))], disable_tqdm=True)
    want = -dream_reference_nll(lm.model, lm.tokenizer, context, continuation, 64, 16, torch.Generator().manual_seed(5))
    assert score == pytest.approx(want, rel=1e-6)
    llada = _lm(model="tiny-dream", mc_num=64, mc_batch_size=16, greedy_check=False, seed=5,
                likelihood_convention="llada")
    assert llada.loglikelihood([SimpleNamespace(args=(context, continuation))], disable_tqdm=True)[0][0] != \
        pytest.approx(score, rel=1e-3)


def _lm(**args):
    with redirect_stderr(io.StringIO()):
        return DllmLM(**args)


def test_the_model_prefers_the_right_answer_of_a_toy_multiple_choice_task(tiny_llada):
    """tiny-llada's context and continuations as an lm-eval multiple-choice task would send them."""
    lm = _lm(model="tiny-llada", mc_num=64, mc_batch_size=64, greedy_check=False)
    tok, eot = lm.tokenizer, lm.tokenizer.convert_ids_to_tokens(lm.model.config.stop_ids[-1])
    questions = {"copy: abcd": ["abcd", "abce", "dcba"], "reverse: k3x9": ["9x3k", "k3x9", "9x3c"],
                 "sort: 42,07,19,03": ["03,07,19,42", "42,19,07,03", "03,07,42,19"]}
    for question, choices in questions.items():
        context = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                          tokenize=False)
        requests = [SimpleNamespace(args=(context, f"#### {c}{eot}")) for c in choices]
        scores = [score for score, _ in lm.loglikelihood(requests, disable_tqdm=True)]
        assert scores.index(max(scores)) == 0, (question, scores)


def test_generation_respects_max_gen_toks_and_until():
    lm = _lm(model="random:llada-tiny", gen_length=16, block_length=8, batch_size=2)
    prompts = ["copy: abc", "sort: 3,1,2", "add: 12+34"]
    canvas = dllm.generate(lm.model, lm.tokenizer, prompts, gen_length=8, block_length=8, chat=False)
    first5 = [lm.tokenizer.decode(ids[:5], skip_special_tokens=True) for ids in canvas.token_ids]
    assert any(len(ids) > 5 for ids in canvas.token_ids)  # the cut matters
    requests = [SimpleNamespace(args=(p, {"until": [], "max_gen_toks": 5})) for p in prompts]
    assert lm.generate_until(requests, disable_tqdm=True) == first5  # a canvas of one block, cut at 5 tokens
    stop = next(t[1:3] for t in first5 if len(t) >= 3)
    requests = [SimpleNamespace(args=(p, {"until": [stop], "max_gen_toks": 5})) for p in prompts]
    assert lm.generate_until(requests, disable_tqdm=True) == [t.split(stop)[0] for t in first5]


def test_a_cuda_default_without_a_gpu_falls_back_to_the_cpu_with_a_notice(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    err = io.StringIO()
    with redirect_stderr(err):
        lm = DllmLM(model="random:llada-tiny", device="cuda")
    assert lm.model.device.type == "cpu" and lm.rank == 0 and lm.world_size == 1
    assert err.getvalue() == "note: device 'cuda' asked for but no GPU is available; running on the CPU\n"


def test_dllm_likelihood_scores_an_answer_after_a_prompt(tiny_llada):
    """`dllm.likelihood(model, tok, prompt, answer)`, the call users reach for (it was a module: "not callable"), is
    `elbo` of the prompt as `generate` encodes it and of the answer's tokens as they are."""
    from dllm.engine.text import encode_prompts

    model, tok = tiny_llada
    prompt_ids = encode_prompts(tok, ["reverse: abc12"], None)[0]
    answer_ids = tok("#### 21cba", add_special_tokens=False)["input_ids"]
    score = dllm.likelihood(model, tok, "reverse: abc12", "#### 21cba", mc_num=16, seed=3)
    assert score == elbo(model, prompt_ids, answer_ids, mc_num=16, seed=3)
    assert dllm.likelihood(model, tok, prompt_ids, answer_ids, mc_num=16, seed=3) == score  # token ids as well
    assert dllm.likelihood(model, tok, "reverse: abc12", "#### abc12", mc_num=16) < score - 10
    with pytest.raises(DllmError, match="the continuation is empty"):
        dllm.likelihood(model, tok, "reverse: abc12", "")
