"""WeDLM's streaming parallel decoding in the one loop (layouts.SlidingWindow, the sampler wedlm, the frontier
cache) against the transcription of the authors' engine loop (tests/wedlm_reference.py): the same answer, one
forward fewer (the engine's commit-only forward at the end, spec `wedlm.md` 2.5, which its own statistic does not
count either), on a random Qwen3-shaped WeDLM in float64 (float32 differences between the reordered and the ranked
forward can flip `< tau`); the exact frontier cache equal to recomputing everything with fewer rows computed; a
batch of unequal prompts equal to each alone; and the refusals."""
import dataclasses
import json

import pytest
import torch
from wedlm_reference import wedlm_reference

import dllm
from dllm.cli import main
from dllm.core.errors import DllmError
from dllm.engine.decoding import decoded
from dllm.engine.layouts import Blocks, SlidingWindow
from dllm.engine.loop import Batch
from dllm.models import PRESETS
from dllm.models.loading import build_model, init_random

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
# (W, tau, lambda): the random model's entropies are 3.9-4.2 nats, so 4.05-4.3 fill some masks of a window and not
# others; 1e9 fills every mask, None one a step
SETTINGS = [(1, 0.4, 0.02), (2, None, 0.0), (4, 4.1, 0.01), (4, 1e9, 1.0), (16, 0.4, 0.02), (16, 4.05, 0.0),
            (16, 4.3, 0.05)]


@pytest.fixture(scope="module")
def model():
    model = build_model(PRESETS["wedlm-tiny"], "cpu", torch.float64)
    init_random(model, 1, std=0.2)
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer():
    return dllm.load("random:wedlm-tiny")[1]


def ours(model, prompts, window, tau, lam, max_tokens, cache="frontier", seeds=0):
    """dllm's decode of `prompts` with the sampler wedlm: the batch (answers, statistics)."""
    sampler = dllm.samplers.SAMPLERS.create("wedlm", window_size=window, entropy_threshold=tau, pos_penalty=lam)
    batch = decoded(model, prompts, sampler, dllm.cache.CACHES.create(cache), max_tokens, max_tokens, seed=seeds)
    return [batch.answer(row) for row in batch.rows], batch.finish()


def alone(model, stops):
    """The model's config with these stop ids (the reference is given the same; the filler, where an answer ends,
    stays one)."""
    return dataclasses.replace(model.config, stop_ids=stops)


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("max_tokens", [3, 16, 40])  # below, at and far above the window of 16
def test_the_window_equals_the_authors_loop(model, prompt, max_tokens, monkeypatch):
    """Every (W, tau, lambda), without a stop and with a stop id the answer holds mid-window: the answer the
    engine returns (less its stop, which our answers end before), its forwards less one."""
    config, parallel = model.config, 0
    for window, tau, lam in SETTINGS:
        monkeypatch.setattr(model, "config", config)
        free = wedlm_reference(model, prompt, window, tau, lam, max_tokens, config.stop_ids)
        for stops in (config.stop_ids, (*config.stop_ids, free.tokens[min(2, len(free.tokens) - 1)])):
            monkeypatch.setattr(model, "config", alone(model, stops))
            want = wedlm_reference(model, prompt, window, tau, lam, max_tokens, stops)
            answers, stats = ours(model, [prompt], window, tau, lam, max_tokens)
            cut = want.tokens[:-1] if want.tokens[-1] in stops else want.tokens
            assert (answers[0], stats.nfe) == (cut, want.forwards - 1), (window, tau, lam, stops)
            assert stats.gen_tokens == len(want.tokens)  # the stop counted, nothing after the answer's end
            parallel += max(map(len, want.fills)) > 1
    assert parallel > len(SETTINGS)  # parallel fills, not one a step only


def test_the_frontier_cache_computes_w_plus_p_rows(model):
    """The frontier cache gives the tokens of recomputing everything with fewer rows: per forward the window and
    the slots committed since the last (W + p rows, the engine's), the first forward the prompt too."""
    prompt = PROMPTS[0]
    for window, tau, lam in SETTINGS:
        none, none_stats = ours(model, [prompt], window, tau, lam, 24, cache="none")
        frontier, stats = ours(model, [prompt], window, tau, lam, 24)
        want = wedlm_reference(model, prompt, window, tau, lam, 24, model.config.stop_ids)
        assert frontier == none and stats.nfe == none_stats.nfe
        rows = sum(stats.rows_per_layer) // model.config.n_layers
        assert rows == len(prompt) + sum(want.rows[:stats.nfe]) < sum(none_stats.rows_per_layer)


def test_a_batch_of_unequal_prompts_equals_each_alone(model):
    """Left padding, per-row settings and seeds: each row's answer is its answer alone."""
    settings = [(16, 0.4, 0.02, 3), (4, 4.1, 0.01, 7), (2, None, 0.0, 5)]
    prompts = [PROMPTS[0], PROMPTS[1], [3, 4]]
    samplers = [dllm.samplers.SAMPLERS.create("wedlm", window_size=w, entropy_threshold=tau, pos_penalty=lam,
                                              temperature=0.7) for w, tau, lam, _ in settings]
    cache = dllm.cache.CACHES.create("frontier")
    batch = Batch(model, samplers[0], cache, 20, 20)
    rows = [batch.add(p, 20, seed, sampler=s) for p, s, (*_, seed) in zip(prompts, samplers, settings)]
    while batch.running:
        batch.run_block()
    for p, s, (*_, seed), row in zip(prompts, samplers, settings, rows):
        single = Batch(model, s, cache, 20, 20)
        own = single.add(p, 20, seed)
        while single.running:
            single.run_block()
        assert batch.answer(row) == single.answer(own)
    assert len({tuple(batch.answer(row)) for row in rows}) == 3


def test_the_wedlm_family_decodes_with_wedlm_and_the_frontier_cache(model, tokenizer):
    got = dllm.generate(model, tokenizer, PROMPTS, gen_length=8)
    assert (got.sampler["name"], got.cache["name"]) == ("wedlm", "frontier")
    assert got.sampler["window_size"] == 16 and got.sampler["entropy_threshold"] == 0.4
    want = [wedlm_reference(model, p, 16, 0.4, 0.02, 8, model.config.stop_ids).tokens for p in PROMPTS]
    assert got.token_ids == [[t for t in w if t not in model.config.stop_ids] for w in want]


def test_explain_says_the_window_not_a_schedule_decides_the_steps(capsys):
    """`dllm generate --explain` on a WeDLM: the sampler wedlm has no blocks and no steps (its window W decides each
    step's fills); a caller's --steps or --block-length is refused in one line, not checked against blocks."""
    assert main(["generate", "hi", "--model", "random:wedlm-tiny", "--gen-length", "50", "--explain"]) == 0
    text = capsys.readouterr().out
    assert "sampler = 'wedlm'" in text and "one token per step" not in text and "block_length = 50" in text
    assert ("(not used: sampler 'wedlm' fills masks of its window of W = 16 after each row's committed prefix, at "
            "least one a step, until the answer is done)") in text
    for flag, value in (("--steps", "7"), ("--block-length", "32")):
        assert main(["generate", "hi", "--model", "random:wedlm-tiny", flag, value, "--sampler-arg",
                     "window_size=4"]) == 2
        assert capsys.readouterr().err == (
            f"error: {flag[2:].replace('-', '_')} does not apply to sampler 'wedlm', which has no blocks and no "
            f"schedule of steps: each step fills masks of its window of W = 4 slots; drop {flag[2:].replace('-', '_')}"
            f" (the window's size is the sampler parameter window_size)\n")


def test_refusals(model, tokenizer):
    llada, llada_tok = dllm.load("random:llada-tiny")
    with pytest.raises(DllmError, match="sampler 'wedlm' cannot decode llada: .*causal.*use low_confidence"):
        dllm.generate(llada, llada_tok, ["hi"], sampler="wedlm", gen_length=8)
    with pytest.raises(DllmError, match="does not follow; use cache frontier"):
        dllm.generate(model, tokenizer, ["hi"], sampler="wedlm", cache="block", gen_length=8)
    with pytest.raises(DllmError, match=r"on a causal model \(wedlm\) use cache frontier \(exact\), block, none, "
                                        r"prefix or dual$"):
        dllm.generate(model, tokenizer, ["hi"], sampler="threshold", cache="dkv", gen_length=8, block_length=8)
    with pytest.raises(DllmError, match=r"which a causal model \(wedlm\) predicts only from finished blocks"):
        dllm.generate(model, tokenizer, ["hi"], sampler="prophet", gen_length=8, block_length=8)
    wedlm, low = (dllm.samplers.SAMPLERS.create(name) for name in ("wedlm", "low_confidence"))
    with pytest.raises(DllmError, match="give it layouts.SlidingWindow"):
        Batch(model, wedlm, dllm.cache.CACHES.create("none"), 8, 8, layout=Blocks())
    with pytest.raises(DllmError, match="use sampler wedlm there"):
        Batch(model, low, dllm.cache.CACHES.create("none"), 8, 8, layout=SlidingWindow())


def test_a_row_joins_at_any_step(model):
    """Each step is a block: a row added after some steps of another (the batch laid out anew, the fronts aligned,
    a fresh frontier store) leaves both answers as they are alone."""
    sampler, cache = dllm.samplers.SAMPLERS.create("wedlm", window_size=4, entropy_threshold=4.1), \
        dllm.cache.CACHES.create("frontier")
    alone = []
    for prompt in PROMPTS:
        single = Batch(model, sampler, cache, 24, 24)
        row = single.add(prompt, 24)
        while single.running:
            single.run_block()
        alone.append(single.answer(row))
    for steps in (1, 3):
        batch = Batch(model, sampler, cache, 24, 24)
        first = batch.add(PROMPTS[0], 24)
        for _ in range(steps):
            batch.run_block()
        assert 0 < len(batch.answer(first)) < 24  # committed tokens, final already
        assert alone[0][:len(batch.answer(first))] == batch.answer(first)
        second = batch.add(PROMPTS[1], 24)
        while batch.running:
            batch.run_block()
        assert [batch.answer(first), batch.answer(second)] == alone


def test_stream_gives_each_steps_committed_text(model, tokenizer):
    s = dllm.stream(model, tokenizer, PROMPTS[0], gen_length=24, window_size=4,
                    entropy_threshold=4.1)
    pieces = list(s)
    got = dllm.generate(model, tokenizer, [PROMPTS[0]], gen_length=24, window_size=4,
                        entropy_threshold=4.1)
    assert "".join(pieces) == got.texts[0] and s.generation.stats.nfe == got.stats.nfe
    assert len(pieces) > 2  # not one block: a piece per step that commits


def test_the_server_streams_each_step_and_takes_a_request_at_any_step(model, tokenizer):
    """`dllm serve`'s engine: a WeDLM request's tokens arrive step by step (final once committed), a request added
    two steps after another joins its batch at once, and each answer is its answer alone."""
    pytest.importorskip("msgspec")
    from dllm.engine.guidance import Guidance
    from dllm.serve.messages import Add
    from dllm.serve.scheduler import Engine

    engine = Engine(model, tokenizer, max_batch=4)
    sampler = dllm.samplers.SAMPLERS.create("wedlm", window_size=4, entropy_threshold=4.1)
    got: dict[str, list] = {"r0": [], "r1": []}
    deltas: dict[str, int] = {"r0": 0, "r1": 0}

    def collect():
        for d in engine.take():
            assert d.status == 0 and d.start == len(got[d.req_id])
            got[d.req_id] += d.token_ids
            deltas[d.req_id] += bool(d.token_ids)

    def add(req_id, prompt):
        engine.add(Add(req_id, prompt, 24, 24, 24, sampler.config(), {"name": "frontier"}, Guidance().config(), 0))

    add("r0", PROMPTS[0])
    for _ in range(2):
        engine.step()
        collect()
    add("r1", PROMPTS[1])
    engine.step()
    collect()
    assert len(engine.groups) == 1 and len(engine.groups[0].batch.rows) == 2  # joined the running batch
    while engine.busy:
        engine.step()
        collect()
    alone = [ours(model, [p], 4, 4.1, 0.02, 24)[0][0] for p in PROMPTS]
    assert [got["r0"], got["r1"]] == alone
    assert deltas["r0"] > 3 and deltas["r1"] > 3


def test_a_joining_row_keeps_the_filled_mask_ids_of_the_running_one(model):
    """A network that predicts the mask id (the spec's trap: the authors' engine outputs it) fills slots with it;
    a batch laid out anew for a joining row keeps which slots were filled (not `token != mask id`), so the running
    row's answer is still its answer alone."""
    import copy

    predicts_mask = copy.deepcopy(model)
    with torch.no_grad():  # the mask id scores a little above token 95 wherever 95 leads
        predicts_mask.lm_head.weight[model.config.mask_id] = model.lm_head.weight[95] * 1.02
    sampler, cache = dllm.samplers.SAMPLERS.create("wedlm", window_size=4, entropy_threshold=4.1), \
        dllm.cache.CACHES.create("frontier")
    alone = [ours(predicts_mask, [p], 4, 4.1, 0.02, 24)[0][0] for p in PROMPTS]
    assert model.config.mask_id in alone[0]
    for steps in (3, 5, 7):
        batch = Batch(predicts_mask, sampler, cache, 24, 24)
        first = batch.add(PROMPTS[0], 24)
        for _ in range(steps):
            batch.run_block()
        second = batch.add(PROMPTS[1], 24)
        while batch.running:
            batch.run_block()
        assert [batch.answer(first), batch.answer(second)] == alone


def test_block_wise_decoding_is_exact_with_the_frontier_and_block_caches(model, tokenizer):
    """Other samplers decode a WeDLM in blocks under the same rank rule (masks of the block see its filled tokens
    wherever they are): the frontier and block caches give the tokens of recomputing everything, with fewer rows."""
    runs = {cache: dllm.generate(model, tokenizer, PROMPTS, sampler="low_confidence", cache=cache, gen_length=16,
                                 block_length=4, steps=8, chat=False) for cache in ("none", "frontier", "block")}
    assert runs["frontier"].token_ids == runs["block"].token_ids == runs["none"].token_ids
    rows = {cache: sum(run.stats.rows_per_layer) for cache, run in runs.items()}
    assert rows["frontier"] < rows["none"] and rows["block"] < rows["none"]


def test_the_answer_canvas_and_the_trace_end_at_max_tokens_not_the_window_slack(model, tokenizer, tmp_path):
    """The window runs W - 1 slots past max_tokens (its slack); the answer canvas, the trace's answer span and so
    the decoding-order plot's positions end at max_tokens."""
    from dllm.engine.trace import read_trace, trace_lines

    got = dllm.generate(model, tokenizer, PROMPTS, gen_length=24, window_size=8, chat=False, trace=True)
    assert [len(c) for c in got.canvas_ids] == [24] * len(PROMPTS)
    assert [end - start for start, end in got.answer_spans] == [24] * len(PROMPTS)
    (tmp_path / "t.jsonl").write_text(trace_lines(got, model.config.mask_id))
    orders = read_trace(tmp_path / "t.jsonl")
    assert [order.length for order in orders] == [24] * len(PROMPTS)
    assert [set(order.committed) >= set(range(len(ids))) for order, ids in zip(orders, got.token_ids)] == [
        True] * len(PROMPTS)  # (every answer token was committed at some step)


def test_eval_runs_the_window_without_blocks_or_steps(tmp_path, capsys):
    """A task with its own answer length (ParallelBench's, which sets blocks and steps to it on other samplers) and
    the CLI's settled lengths decode a WeDLM in its window: no block_length or steps reach it."""
    from pathlib import Path

    from dllm.eval.harness import evaluate

    model, tok = dllm.load("random:wedlm-tiny")
    fixture = Path(__file__).parent / "data" / "parallelbench"
    evaluate(model, tok, "parallelbench/waiting_line/copy", data=fixture, limit=1, output=tmp_path / "pb")
    config = json.loads((tmp_path / "pb" / "summary.json").read_text())["config"]
    assert (config["sampler"]["name"], config["steps"]) == ("wedlm", None)
    assert config["block_length"] == config["gen_length"]
    assert main(["eval", "--task", "synthetic", "--model", "random:wedlm-tiny", "--limit", "2", "--gen-length", "8",
                 "--output", str(tmp_path / "cli")]) == 0
