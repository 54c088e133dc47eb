"""`speculative` against FreeDave (cychomatica/FreeDave `generation/core.py`, spec strategies_2026.md section 9 and
adablock_selfspec.md part B): a plain transcription of `block_decode_with_full_attention_FreeDave` (batch 1, drafts
verified by batch expansion) and of its static reference `block_decode_with_full_attention`, run on our models and
compared token for token and forward for forward with our decode, on the shipped tiny models."""
import functools
import re

import pytest
import torch
from conftest import ROOT, random_model

import dllm
from dllm import cache as caches
from dllm import samplers
from dllm.engine import decode
from dllm.engine.text import encode_prompts
from dllm.models import Rows

PROMPTS = ["reverse: abc12", "sort: 42,07,19,03", "add: 0457+0168", "copy: k3x9a"]


class FrozenKV:
    """FreeDave's caches as its loop uses them: the block-start forward writes every row's keys and values; a later
    forward computes canvas rows `[a, b)` of each of its batch rows (the drafts) and attends to the frozen rows
    before `a`, its own rows and the frozen rows from `b` (DynamicDualCache's composition; the prefix cache, cropped
    at the block start, is b = the canvas end). Nothing a later forward computes is kept."""

    def __init__(self):
        self.k, self.v = [], []

    def expand(self, layer, rows, x):
        return None

    def attention_rows(self, layer, rows):
        return None

    def layer_rows(self, layer, rows, x):
        return None

    def observe_output(self, rows, x):
        pass

    def update(self, layer, rows, q, k, v):
        if len(self.k) == layer:  # the block-start forward
            self.k.append(k)
            self.v.append(v)
            return k, v
        a, b, n = rows.index.start, rows.index.stop, k.shape[0]
        fk, fv = self.k[layer].expand(n, -1, -1, -1), self.v[layer].expand(n, -1, -1, -1)
        return torch.cat((fk[:, :, :a], k, fk[:, :, b:]), 2), torch.cat((fv[:, :, :a], v, fv[:, :, b:]), 2)


class Forwards:
    """The model calls of one generation, counted (`nfe`, and `rows`: canvas rows computed, summed over the batch):
    `full` (the block start: the whole canvas, a fresh cache) and `window` (canvases that differ from `x` only in
    the block, one forward for all of them). Returns logits aligned as FreeDave's `get_processed_model_outputs`
    aligns them (Dream: the computed rows' outputs shifted right by one, the first repeated), MASK's logit -inf
    (the toolkit never proposes MASK, see `samplers.base`)."""

    def __init__(self, model, cache):
        self.model, self.cache, self.nfe, self.rows = model, cache, 0, 0

    def _run(self, tokens, a, b, kv):
        self.nfe += 1
        self.rows += tokens.numel()
        positions = torch.arange(a, b).expand(tokens.shape[0], -1)
        logits = self.model.run(tokens, positions, None, kv, Rows(slice(a, b)))
        if self.model.config.logit_shift:
            logits = torch.cat((logits[:, :1], logits[:, :-1]), 1)
        logits[..., self.model.config.mask_id] = float("-inf")
        return logits

    def full(self, x):
        self.kv = None if self.cache == "none" else FrozenKV()
        return self._run(x[None], 0, len(x), self.kv)[0]

    def window(self, x, blocks, s, e):
        """Logits `[K, e - s, V]` of the block of `x` with each of `blocks` `[K, e - s]` in it."""
        if self.cache == "none":
            canvases = x.repeat(len(blocks), 1)
            canvases[:, s:e] = blocks
            return self._run(canvases, 0, len(x), None)[:, s:e]
        if self.cache == "dual":
            return self._run(blocks, s, e, self.kv)
        rest = x[s:].repeat(len(blocks), 1)  # prefix: the block and everything after it
        rest[:, :e - s] = blocks
        return self._run(rest, s, len(x), self.kv)[:, :e - s]


def predict(logits, masked):
    """`get_mask_token_prediction_and_confidence` at temperature 0: argmax and its softmax probability at masked
    positions, -inf confidence elsewhere."""
    tokens = logits.argmax(-1)
    confidence = logits.softmax(-1).gather(-1, tokens[..., None])[..., 0]
    return tokens, confidence.masked_fill(~masked, float("-inf"))


def top(confidence, count):
    """The `count` most confident positions, equal confidences by lowest position. FreeDave calls `torch.topk`,
    which leaves the order of equal values unspecified (on a CPU it took [1, 4, 2] of three positions at exactly
    1.0, which the trained tiny models' float32 softmax gives often), so one draft's ranking and the next forward's
    could break one tie two ways; both decoders here break ties alike, as the spec asks (adablock_selfspec.md B1)."""
    return (-confidence).sort(stable=True).indices[:count]


def transfer(block, tokens, confidence, mask_id, count=1, threshold=None):
    """`token_transfer` (alg_temp 0) for one draft: with a threshold, every masked position whose confidence reaches
    it, else the `count` most confident masked ones."""
    masked = block == mask_id
    confidence = confidence.masked_fill(~masked, float("-inf"))
    chosen = confidence >= threshold if threshold is not None else torch.zeros_like(masked)
    if not chosen.any():
        chosen = torch.zeros_like(masked)
        chosen[top(confidence, min(count, int(masked.sum())))] = True
    return torch.where(chosen, tokens, block)


def drafts_of(block, tokens, confidence, mask_id, n, threshold=None):
    """`token_transfer` with `draft_steps=n`: draft k fills the top k + 1; with a threshold (FreeDave++), draft 0 is
    the threshold step and draft k adds the top k of the rest."""
    if threshold is None:
        return torch.stack([transfer(block, tokens, confidence, mask_id, k + 1) for k in range(n)])
    first = transfer(block, tokens, confidence, mask_id, threshold=threshold)
    return torch.stack([first] + [transfer(first, tokens, confidence, mask_id, k) for k in range(1, n)])


def accepted(drafts, targets, mask_id, equal=False):
    """`draft_verification_looped`: from draft 0, move to the last later draft that agrees with the target of the
    draft reached, until none does. FreeDave's agreement (`match_rule='subset'`): every decoded position of the
    draft holds the target's token (an all-mask draft always agrees); `equal`: the draft is the target."""
    best = 0
    while best < len(drafts) - 1:
        ref = best
        for j in range(best + 1, len(drafts)):
            decoded = drafts[j] != mask_id
            if equal:
                agrees = torch.equal(drafts[j], targets[ref])
            else:
                agrees = not decoded.any() or torch.equal(drafts[j][decoded], targets[ref][decoded])
            if agrees:
                best = j
        if best == ref:
            break
    return best


def freedave_generate(model, prompt, gen_length, block_length, draft_steps, cache="dual", threshold=None,
                      equal=False):
    """`block_decode_with_full_attention_FreeDave` (non-eager, batch expansion, temperature 0, alg_temp 0,
    early_exit off; `threshold`: FreeDave++'s confidence_threshold) step by step; `equal`: drafts accepted by
    equality (`accepted`). Returns the answer tokens, the forwards, the rows they computed, the rows of those that
    went to drafts that had filled the block and how many forwards verified drafts whose draft 0 had filled it
    (FreeDave++)."""
    cfg = model.config
    mask_id, dream = cfg.mask_id, bool(cfg.logit_shift)
    x = torch.tensor(prompt + [mask_id] * gen_length)
    run, full_rows, idle = Forwards(model, cache), 0, 0
    for s in range(len(prompt), len(x), block_length):
        e = s + block_length
        logits = run.full(x)
        if dream:  # the block's first position from the block-start forward, whatever its confidence
            x[s] = logits[s].argmax()
        if not (x[s:e] == mask_id).any():
            continue
        tokens, confidence = predict(logits[s:e], x[s:e] == mask_id)  # the block-start forward's, reused
        first = True
        while True:
            masks = int((x[s:e] == mask_id).sum())
            n = min(draft_steps, masks)
            if first and dream:  # the block as it is is draft 0 (FreeDave++'s threshold not applied)
                rest = drafts_of(x[s:e], tokens, confidence, mask_id, n - 1) if n > 1 else x[s:e][None][:0]
                drafts = torch.cat((x[s:e][None], rest))
            else:
                drafts = drafts_of(x[s:e], tokens, confidence, mask_id, n, threshold)
            first = False
            if masks <= 1:  # the last mask: draft 0, no forward
                x[s:e] = drafts[0]
                break
            idle += int(not (drafts[0] == mask_id).any())
            before = run.rows
            logits = run.window(x, drafts, s, e)
            full_rows += int((drafts != mask_id).all(1).sum()) * (run.rows - before) // n
            predicted = [predict(logits[k], drafts[k] == mask_id) for k in range(n)]
            targets = torch.stack([transfer(d, t, c, mask_id, threshold=threshold)
                                   for d, (t, c) in zip(drafts, predicted)])
            best = accepted(drafts, targets, mask_id, equal)
            x[s:e] = drafts[best]
            tokens, confidence = predicted[best]
            if not (x[s:e] == mask_id).any():
                break
    return x[len(prompt):].tolist(), run.nfe, run.rows, full_rows, idle


def static_generate(model, prompt, gen_length, block_length, cache="dual", threshold=None):
    """`block_decode_with_full_attention` (one token per step, or Fast-dLLM's threshold rule; temperature 0,
    alg_temp 0, decoding_steps = gen_length) step by step: FreeDave's lossless reference. Returns the answer
    tokens and the forwards."""
    cfg = model.config
    mask_id = cfg.mask_id
    x = torch.tensor(prompt + [mask_id] * gen_length)
    run = Forwards(model, cache)
    for s in range(len(prompt), len(x), block_length):
        e = s + block_length
        logits = run.full(x)
        if cfg.logit_shift:
            x[s] = logits[s].argmax()
        else:
            x[s:e] = transfer(x[s:e], *predict(logits[s:e], x[s:e] == mask_id), mask_id, threshold=threshold)
        for _ in range(1, block_length):
            if not (x[s:e] == mask_id).any():
                break
            logits = run.window(x, x[s:e][None], s, e)[0]
            x[s:e] = transfer(x[s:e], *predict(logits, x[s:e] == mask_id), mask_id, threshold=threshold)
    return x[len(prompt):].tolist(), run.nfe


@functools.cache
def model_and_prompts(name):
    """A shipped tiny model with the prompts through its chat template, or a random preset with token prompts."""
    if name.startswith("tiny-"):
        model, tok = dllm.load(name)
        return model, encode_prompts(tok, PROMPTS, chat=True)
    return random_model(name), [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]


@pytest.fixture(params=["tiny-llada", "tiny-dream"])
def tiny(request):
    return request.param


def ours(model, prompts, gen_length, block_length, cache, sampler="speculative", **params):
    """Our decode of `prompts` as one batch: each row's answer tokens, and the statistics."""
    canvas, stats, _ = decode(model, prompts, samplers.SAMPLERS.create(sampler, **params),
                              caches.CACHES.create(cache), gen_length, block_length, stop_early=False)
    return canvas.tokens[:, canvas.prompt_length:].tolist(), stats


@functools.cache
def static_tokens(name, prompt, cache, threshold=None):
    return static_generate(*model_and_prompts(name)[:1], list(prompt), 16, 8, cache, threshold)[0]


@pytest.mark.parametrize("draft_steps,cache", [(4, "none"), (4, "dual"), (4, "prefix"), (1, "none"), (1, "dual"),
                                               (8, "none"), (8, "dual")])
def test_speculative_is_freedave_token_for_token_and_forward_for_forward(tiny, draft_steps, cache):
    """Fidelity configurations (a) D 4, (b) D 1, (c) D 8 at G 16, B 8, with each of FreeDave's caches (prefix: its
    non-dual path) and none; Dream with FreeDave's Dream path (`force_first`): the tokens and forwards of FreeDave's
    loop, and the tokens of its static reference (lossless). The rows computed are FreeDave's but for its drafts
    that fill the block, which ours leaves out of the verification batch: the target of the draft before decides
    it, and its own logits are never read (the block is done), so the next step commits it without a forward."""
    name, (model, prompts) = tiny, model_and_prompts(tiny)
    for prompt in prompts[::2]:
        want, nfe, rows, full_rows, _ = freedave_generate(model, prompt, 16, 8, draft_steps, cache)
        got, stats = ours(model, [prompt], 16, 8, cache, draft_steps=draft_steps,
                          force_first=bool(model.config.logit_shift))
        assert got[0] == want and stats.nfe == nfe and stats.rows_per_layer[0] == rows - full_rows
        assert want == static_tokens(name, tuple(prompt), cache)


@pytest.mark.parametrize("cache", ["none", "dual"])
@pytest.mark.parametrize("name,threshold", [("tiny-llada", 0.5), ("tiny-dream", 0.5), ("tiny-llada", 0.9999999),
                                            ("tiny-dream", 0.9999999), ("llada-tiny", 0.2), ("dream-tiny", 0.2)])
def test_threshold_is_threshold_decoding_in_at_most_its_forwards(name, threshold, cache):
    """Fidelity configuration (d), and thresholds where threshold decoding often commits one token a step: with
    `threshold`, speculative gives sampler threshold's tokens (one batch of all prompts) in at most its forwards."""
    model, prompts = model_and_prompts(name)
    want, plain = ours(model, prompts, 16, 8, cache, sampler="threshold", threshold=threshold)
    got, stats = ours(model, prompts, 16, 8, cache, threshold=threshold)
    assert got == want and stats.nfe <= plain.nfe


@pytest.mark.parametrize("draft_steps,cache", [(4, "none"), (4, "dual"), (8, "dual")])
def test_threshold_is_freedave_plus_plus_accepting_only_equal_drafts(tiny, draft_steps, cache):
    """FreeDave++ (confidence_threshold 0.9) with two changes gives our tokens and forwards: a draft is accepted only
    when it equals the target (see the next test), and a draft 0 that fills the block is committed without the
    verification forward FreeDave spends on it. Those tokens are its static reference's: threshold decoding (on
    Dream with the block's first token forced, as Fast-dLLM's Dream decoding)."""
    name, (model, prompts) = tiny, model_and_prompts(tiny)
    for prompt in prompts[::2]:
        want, nfe, rows, full_rows, idle = freedave_generate(model, prompt, 16, 8, draft_steps, cache, 0.9, equal=True)
        got, stats = ours(model, [prompt], 16, 8, cache, draft_steps=draft_steps, threshold=0.9,
                          force_first=bool(model.config.logit_shift))
        assert got[0] == want and stats.nfe == nfe - idle and stats.rows_per_layer[0] == rows - full_rows
        assert want == static_tokens(name, tuple(prompt), cache, 0.9)


def test_freedave_plus_plus_subset_rule_leaves_threshold_decoding():
    """Why ours accepts only a draft equal to the target: FreeDave++ accepts draft j when its decoded positions hold
    the target's tokens (`match_rule='subset'`), so where the target commits two tokens and d_1 holds one of them it
    moves to d_1, a state threshold decoding never reaches. On tiny-dream at threshold 0.5 some answers then differ
    from the static reference's; accepting equal drafts only, all are the reference's."""
    model, prompts = model_and_prompts("tiny-dream")
    static = [static_tokens("tiny-dream", tuple(p), "none", 0.5) for p in prompts]
    assert [freedave_generate(model, p, 16, 8, 4, "none", 0.5)[0] for p in prompts] != static
    assert [freedave_generate(model, p, 16, 8, 4, "none", 0.5, equal=True)[0] for p in prompts] == static


def test_results_say_whose_rule_speculative_is_where_its_rows_are():
    """RESULTS.md names FreeDave in every section with a `speculative` row, as `dllm list samplers` does."""
    assert "FreeDave" in samplers.SAMPLERS.get("speculative").describe()["doc"]
    sections = (ROOT / "RESULTS.md").read_text().split("\n## ")
    with_rows = [s for s in sections if re.search(r"^\| [^|\n]*\bspeculative\b", s, re.M)]
    assert len(with_rows) == 3 and all("FreeDave" in s for s in with_rows)
