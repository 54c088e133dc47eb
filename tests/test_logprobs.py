"""`logprobs=k`: each answer token's log-probability under the distribution its sampler drew it from, captured at the
step that wrote it, checked against a replay of the traced steps with the model's own full forward."""
import pytest
import torch
from conftest import PC_TABLE, random_model

import dllm
from dllm import cache as caches
from dllm import samplers
from dllm.core.errors import DllmError
from dllm.engine import Batch
from dllm.engine.decoding import decoded
from dllm.engine.text import encode_prompts

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19, 20, 21, 22]]  # padded rows; each remainder mod 4
TASKS = ["reverse: abc12", "copy: k3x9a"]  # what the shipped tiny models answer (a stop at once on other ids)


def tempered(temperature):
    return lambda logits: (logits / temperature).log_softmax(-1)


def top_k_tempered(k, temperature):
    def distribution(logits):
        logits = logits / temperature
        kth = logits.topk(k, dim=-1).values[..., -1:]
        return logits.masked_fill(logits < kth, float("-inf")).log_softmax(-1)
    return distribution


CASES = {  # model, sampler and its parameters, cache, the distribution its tokens are drawn from (written here anew)
    "llada low_confidence T=0.7": ("tiny-llada", "low_confidence", {"temperature": 0.7}, "none", tempered(0.7)),
    "dream maskgit_plus top_k=5 T=0.8": ("tiny-dream", "maskgit_plus", {"temperature": 0.8, "top_k": 5}, "none",
                                         top_k_tempered(5, 0.8)),
    "sdar low_confidence_dynamic T=0.5 block cache": ("tiny-sdar", "low_confidence_dynamic", {"temperature": 0.5},
                                                      "block", tempered(0.5)),
    "sdar joint_threshold (edits) T=0": ("sdar-tiny", "joint_threshold", {"threshold": 0.5, "edit_threshold": 0.3},
                                         "block", tempered(1.0)),
    "nemotron leftmost T=0.6 block cache": ("nemotron-diffusion-tiny", "leftmost", {"temperature": 0.6}, "block",
                                            tempered(0.6)),
    "nemotron threshold causal_first T=0.6": ("nemotron-diffusion-tiny", "threshold",
                                              {"temperature": 0.6, "causal_first": True}, "block", tempered(0.6)),
}


def load(name):
    """The model and prompts it answers with a few tokens."""
    if name.startswith("tiny-"):
        model, tok = dllm.load(name)
        return model, encode_prompts(tok, TASKS, chat=True)
    return random_model(name, seed=1), PROMPTS


def replay(model, prompt, answer_columns, steps, row, first, distribution, top, block_length, causal_first=False):
    """Row `row` decoded again alone from the trace: before each traced step the model's full forward of the canvas
    as it stood (a causal-prefix model decoding the step's block), and each position written at that step (commits
    and edits) gets its token's log-probability and the k best under `distribution` of those logits (`causal_first`:
    a block's first step commits from the row before it, the causal next-token prediction). Returns them for the
    answer's columns."""
    cfg = model.config
    canvas = torch.tensor(prompt + [cfg.mask_id] * (answer_columns - len(prompt)))
    want = {}
    for step in steps:
        written = step["commits"][row] + step.get("edits", [[]] * (row + 1))[row]
        if not written:
            continue
        start = len(prompt) + step["block"] * block_length  # blocks from the prompt's end (not block-causal)
        with torch.no_grad():
            logits = model(canvas[None], window=(start, start + block_length) if cfg.causal_prefix else None)[0]
        logits[:, cfg.mask_id] = float("-inf")
        log_probs = distribution(logits.double())
        for c in written:
            position = c["position"] - first
            drawn_from = log_probs[position - 1 if causal_first and step["step"] == 0 else position]
            best = drawn_from.topk(top)
            want[position] = (c["token"], float(drawn_from[c["token"]]), best.indices.tolist(), best.values.tolist())
            canvas[position] = c["token"]
    return [want[p] for p in sorted(want) if p >= len(prompt)]


@pytest.mark.parametrize("case", CASES)
def test_logprobs_equal_a_replay_of_the_traced_steps(case):
    """Every answer token of each (left-padded) row: its log-probability and the 3 best of the distribution its
    sampler drew from at the step that wrote it, recomputed with the model's full forward on the canvas as it
    stood before that step. Under token editing, edits happen, and a rewritten token carries the step that
    rewrote it."""
    name, sampler, params, cache, distribution = CASES[case]
    model, prompts = load(name)
    size = model.config.block_size
    batch = decoded(model, prompts, samplers.SAMPLERS.create(sampler, **params), caches.CACHES.create(cache), 16,
                    size or 8, seed=3, trace=True, logprobs=3)
    if "edits" in case:
        assert sum(len(row) for step in batch.trace for row in step["edits"]) > 0
    origins = [len(p) // size * size if size else len(p) for p in prompts]
    for b, (row, prompt) in enumerate(zip(batch.rows, prompts)):
        got = batch.logprobs(row)
        assert [g.token for g in got] == batch.answer(row) and len(got) > 0
        want = replay(model, prompt, len(row.tokens), batch.trace, b, max(origins) - origins[b], distribution, 3,
                      size or 8, params.get("causal_first", False))
        for g, (token, logprob, ids, values) in zip(got, want):
            assert g.token == token and g.logprob == pytest.approx(logprob, abs=1e-4)
            assert [i for i, _ in g.top] == ids and [v for _, v in g.top] == pytest.approx(values, abs=1e-4)


@pytest.mark.parametrize("sampler", [cls.name for cls in samplers.SAMPLERS])
def test_a_greedy_token_is_the_best_of_its_distribution(sampler):
    """At temperature 0 every sampler commits the argmax of the distribution it reports (CreditDecoding's fused
    logits, Dream's truncation), so a token's log-probability is its step's best; and asking for logprobs changes
    no token."""
    if sampler.endswith("_test"):
        pytest.skip("registered by another test")
    if samplers.SAMPLERS.get(sampler).moves_tokens:  # a token's capture cannot follow it: refused
        model = random_model("llada2.2-tiny")
        with pytest.raises(DllmError, match=f"sampler {sampler!r} moves decoded tokens to other positions "
                                            f"\\(insert/delete\\), so a token's log-probability cannot follow it"):
            decoded(model, PROMPTS, samplers.SAMPLERS.create(sampler), caches.CACHES.create("none"), 32,
                    model.config.block_size, logprobs=2)
        return
    model = random_model("llada-tiny", seed=2, std=0.05)  # soft logits: credit's fusion moves some argmaxes
    args = {"prophet": {"answer_start": 2}, "adablock": {"delimiter_ids": "5"}, "pc_sampler": PC_TABLE}.get(sampler, {})
    block = 8
    if samplers.SAMPLERS.get(sampler).slides:  # WeDLM's window runs on a causal model
        model = random_model("wedlm-tiny", seed=2, std=0.05)
    elif samplers.SAMPLERS.create(sampler, **args).check_model(model.config) is not None:  # uniform-state: its argmax
        model = random_model("diffusion-gemma-tiny", seed=2)
        block = model.config.canvas_length

    def run(**kw):
        return decoded(model, PROMPTS, samplers.SAMPLERS.create(sampler, **args), caches.CACHES.create("none"),
                       2 * block, block, **kw)

    batch, plain = run(logprobs=2), run()
    for row, alone in zip(batch.rows, plain.rows):
        assert batch.answer(row) == plain.answer(alone)
        for token in batch.logprobs(row):
            assert token.logprob == pytest.approx(token.top[0][1], abs=1e-6)
            assert token.top[0][1] >= token.top[1][1]


def test_rows_joining_between_blocks_keep_their_logprobs():
    """A row that joins a running batch, and the rows around it re-laid out, report what each reports alone."""
    model, prompts = load("tiny-sdar")
    sampler, cache = samplers.SAMPLERS.create("low_confidence_dynamic", temperature=0.5), caches.CACHES.create("block")

    def alone(prompt, k):
        batch = decoded(model, [prompt], sampler, cache, 16, 4, seed=7, logprobs=k)
        return batch.logprobs(batch.rows[0])

    batch = Batch(model, sampler, cache, 4, 4)
    first = batch.add(prompts[0], 16, seed=7, logprobs=1)
    batch.run_block()
    second = batch.add(prompts[1], 16, seed=7, logprobs=4)  # more alternatives: the capture widens
    third = batch.add(prompts[0], 16, seed=7)  # no logprobs asked
    while batch.running:
        batch.run_block()
    for row, prompt, k in ((first, prompts[0], 1), (second, prompts[1], 4)):
        got, want = batch.logprobs(row), alone(prompt, k)
        assert [(t.token, len(t.top)) for t in got] == [(t.token, k) for t in want] and got
        assert [t.logprob for t in got] == pytest.approx([t.logprob for t in want], abs=1e-5)
    with pytest.raises(DllmError, match="added without logprobs; add it with logprobs=k"):
        batch.logprobs(third)


def test_generate_and_stream_return_logprobs():
    model, tok = dllm.load("tiny-llada")
    out = dllm.generate(model, tok, ["reverse: abc", "copy: hello"], logprobs=2, temperature=0.5, seed=1)
    assert [[t.token for t in row] for row in out.logprobs] == out.token_ids
    s = dllm.stream(model, tok, "copy: hello", logprobs=2, temperature=0.5, seed=1)
    list(s)
    (alone,) = s.generation.logprobs
    assert [(t.token, [i for i, _ in t.top]) for t in alone] == [(t.token, [i for i, _ in t.top]) for t in
                                                                 out.logprobs[1]]
    assert [t.logprob for t in alone] == pytest.approx([t.logprob for t in out.logprobs[1]], abs=1e-5)
    assert dllm.generate(model, tok, "copy: hello").logprobs is None
    for bad, message in ((21, "logprobs must be at most 20, got 21"), (-1, "logprobs must be at least 0"),
                         (True, "logprobs must be an integer, got True")):
        with pytest.raises(DllmError, match=message):
            dllm.generate(model, tok, "copy: hello", logprobs=bad)
