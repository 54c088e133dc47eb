"""DAEDAL, gen_length auto (arXiv 2508.00819), against a plain transcription of the authors' `generate`
(Li-Jinsong/DAEDAL `models/LLaDA_DAEDAL.py`): same canvases and same forwards in the spec's fidelity configurations;
its invariants, batches, samplers and refusals."""
import json
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import random_model

import dllm
from dllm import cache as caches
from dllm import samplers
from dllm.core.errors import DllmError
from dllm.engine.decoding import decoded
from dllm.engine.text import encode_prompts
from dllm.samplers import Daedal

# prompts of one length (18 tokens with the chat template), so the authors' batch, which attends to a left-padded
# prompt's padding, decodes each row as it would alone
TEXTS = ["reverse: abc12", "add: 0457+0168"]
SMALL = dict(initial_gen_length=8, max_gen_length=32, expansion_factor=2, eos_check_tokens=4)  # configuration (a)
RANDOM_IDS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18]]


@pytest.fixture(scope="module")
def tiny(tiny_llada):
    model, tok = tiny_llada
    return model, tok, encode_prompts(tok, TEXTS, chat=True)


@pytest.fixture(scope="module")
def dream(tiny_dream):
    model, tok = tiny_dream
    return model, encode_prompts(tok, TEXTS, chat=True)


@pytest.fixture(scope="module")
def rand():
    """A random LLaDA (confidences near 1/V) whose EOS head row is scaled up, so that positions predict EOS and a
    canvas stops growing: insertions under the default thresholds."""
    model = random_model("llada-tiny", seed=1)
    with torch.no_grad():
        model.lm_head.weight[model.config.filler_id] *= 4
    return model


def reference_daedal(model, prompts, initial_gen_length=64, max_gen_length=2048, block_length=32,
                     high_conf_threshold=0.9, low_conf_threshold=0.1, expansion_factor=8, eos_confidence_threshold=0.5,
                     expand_eos_confidence_threshold=0.9, eos_check_tokens=32):
    """`generate` at temperature 0 and cfg 0, on a batch of prompts of one length, step by step. Stage 1: forward the
    canvas `[prompt | masks]` (each row's keys up to its own length; a shorter row's columns after it hold EOS);
    the EOS confidence of a row: from its last column back to its first answer column, p(EOS) at the positions whose
    argmax is EOS until `eos_check_tokens` are found, summed, divided by `eos_check_tokens`, as a float32 tensor;
    rows below the threshold and shorter than the maximum grow by `expansion_factor` masks (at most to the maximum),
    until none grows or the longest stays as long; then `eos_check_tokens // 2` EOS tokens after the masks (the
    length at most the maximum). Stage 2, a cursor per row at its answer's start, every forward: argmax and its
    probability; fill the masks of the block `[cursor, min(cursor + B, end))` above the high threshold, else the
    most probable one; a row below the EOS threshold of expansion and shorter than the maximum turns the least
    probable mask of the block below the low threshold, not filled now, into `expansion_factor` masks (its tokens
    rewritten left to right into a canvas as wide as the longest new row, at most the maximum); a cursor skips
    whole blocks without masks; stop when no cursor is inside its row, or a step changed nothing. The one change:
    MASK's logit is -inf (the toolkit never proposes MASK, see `samplers.base`), so their fallback for a block whose
    every prediction is MASK never applies. Returns each row's answer canvas, the forwards and how often a canvas
    grew before decoding and while decoding."""
    cfg = model.config
    mask, eos = cfg.mask_id, cfg.filler_id
    p, rows = len(prompts[0]), len(prompts)
    assert all(len(ids) == p for ids in prompts)
    nfe, grown, inserted = 0, 0, 0

    def forward(x, lengths):
        nonlocal nfe
        nfe += 1
        logits = model(x, (torch.arange(x.shape[1]) < p + lengths[:, None]).long())
        logits[..., mask] = float("-inf")
        return logits

    def eos_confidence(logits, lengths):
        probs, predicted = F.softmax(logits, dim=-1), logits.argmax(-1)
        out = []
        for i in range(rows):
            found = []
            for pos in range(p + int(lengths[i]) - 1, p - 1, -1):
                if len(found) >= eos_check_tokens:
                    break
                if predicted[i, pos] == eos:
                    found.append(probs[i, pos, eos].item())
            out.append(sum(found) / eos_check_tokens)
        return torch.tensor(out)

    lengths = torch.full((rows,), initial_gen_length)
    x = torch.full((rows, p + initial_gen_length), mask)
    x[:, :p] = torch.tensor(prompts)
    while True:  # stage 1
        grow = (eos_confidence(forward(x, lengths), lengths) < eos_confidence_threshold) & (lengths < max_gen_length)
        if not grow.any():
            break
        new = lengths.clone()
        new[grow] = (lengths[grow] + expansion_factor).clamp(max=max_gen_length)
        if new.max() <= lengths.max():
            break
        grown += int(grow.sum())
        y = torch.full((rows, p + int(new.max())), eos)
        for i in range(rows):
            y[i, :p + lengths[i]] = x[i, :p + lengths[i]]
            if grow[i]:
                y[i, p + lengths[i]:p + new[i]] = mask
        x, lengths = y, new
    ended = (lengths + eos_check_tokens // 2).clamp(max=max_gen_length)
    y = torch.full((rows, p + int(ended.max())), eos)
    for i in range(rows):
        y[i, :p] = x[i, :p]
        y[i, p:p + lengths[i]] = mask
    x, lengths = y, ended

    cursor = torch.full((rows,), p)
    while (cursor < p + lengths).any():  # stage 2
        total, before = p + lengths, x.clone()
        logits = forward(x, lengths)
        predicted = logits.argmax(-1)
        confidence = F.softmax(logits, dim=-1).gather(-1, predicted[..., None])[..., 0]
        eos_conf = eos_confidence(logits, lengths)
        masked = x == mask
        fill = torch.zeros_like(masked)
        expand = [None] * rows
        for i in range(rows):
            if cursor[i] >= total[i]:
                continue
            start = int(cursor[i])
            block = [j for j in range(start, min(start + block_length, int(total[i]))) if masked[i, j]]
            if not block:
                continue
            high = [j for j in block if confidence[i, j] > high_conf_threshold]
            for j in high or [max(block, key=lambda j: confidence[i, j])]:  # torch.sort; ties: the lowest position
                fill[i, j] = True
            if eos_conf[i] >= expand_eos_confidence_threshold or lengths[i] >= max_gen_length:
                continue
            low = [j for j in block if not fill[i, j] and confidence[i, j] < low_conf_threshold]
            if low:
                expand[i] = min(low, key=lambda j: confidence[i, j])  # torch.topk(largest=False)
        x[fill] = predicted[fill]
        if any(j is not None for j in expand):
            inserted += sum(j is not None for j in expand)
            new = lengths.clone()
            for i in range(rows):
                if expand[i] is not None:
                    new[i] = min(int(lengths[i]) + expansion_factor - 1, max_gen_length)
            width = p + int(new.max())
            y = torch.full((rows, width), eos)
            for i in range(rows):
                if expand[i] is None:
                    y[i, :p + lengths[i]] = x[i, :p + lengths[i]]
                    continue
                y[i, :p] = x[i, :p]
                write = p
                for j in range(p, p + int(lengths[i])):
                    if write >= width:
                        break
                    if j == expand[i]:
                        y[i, write:min(write + expansion_factor, width)] = mask
                        write = min(write + expansion_factor, width)
                    else:
                        y[i, write] = x[i, j]
                        write += 1
                new[i] = write - p
            x, lengths = y, new
        for i in range(rows):
            while cursor[i] < p + lengths[i]:
                end = min(int(cursor[i]) + block_length, p + int(lengths[i]))
                if (x[i, cursor[i]:end] == mask).any():
                    break
                cursor[i] += block_length
        if x.shape == before.shape and torch.equal(x, before):
            break
    return [x[i, p:p + lengths[i]].tolist() for i in range(rows)], nfe, grown, inserted


def ours(model, prompts, length, block_length, sampler="threshold", **kwargs):
    """Each row's answer canvas and the forwards of `decoded` under gen_length auto (every mask decoded, as theirs)."""
    batch = decoded(model, prompts, samplers.SAMPLERS.create(sampler, **kwargs), caches.CACHES.create("none"), length,
                    block_length, stop_early=False)
    return [row.tokens[len(row.prompt):].tolist() for row in batch.rows], batch.finish().nfe


CONFIGS = {
    "a": (dict(SMALL), 4),
    "b_forced_insertions": (dict(SMALL, eos_threshold=0.0, low_threshold=1.0), 4),
    "c_denoise_only": (dict(SMALL, max_gen_length=12), 4),
}
THEIRS = {"initial_gen_length": "initial_gen_length", "max_gen_length": "max_gen_length",
          "eos_threshold": "eos_confidence_threshold", "expand_threshold": "expand_eos_confidence_threshold",
          "low_threshold": "low_conf_threshold", "expansion_factor": "expansion_factor",
          "eos_check_tokens": "eos_check_tokens"}


def reference_args(params: dict, block_length: int) -> dict:
    return {THEIRS[k]: v for k, v in params.items()} | {"block_length": block_length}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_row_alone_equals_the_authors_generate(tiny, rand, name):
    """Same answer canvas and forwards, each prompt alone, on tiny-llada (realistic confidences: no insertion under
    the default low threshold) and a random LLaDA (`rand`); what each configuration is for happens."""
    params, block = CONFIGS[name]
    grown = inserted = 0
    for model, prompts in ((tiny[0], tiny[2]), (rand, RANDOM_IDS)):
        for prompt in prompts:
            canvas, nfe, *counts = reference_daedal(model, [prompt], **reference_args(params, block))
            assert ours(model, [prompt], Daedal(**params), block) == ([canvas[0]], nfe)
            grown, inserted = grown + counts[0], inserted + counts[1]
            if name == "c_denoise_only":  # tiny-llada's answers reach max_gen_length, then are only denoised
                assert len(canvas[0]) == 12 if model is tiny[0] else len(canvas[0]) <= 12
    assert (grown > 0) == (name != "b_forced_insertions")  # eos_threshold 0: no growth before decoding
    assert inserted > 0


def test_a_batch_whose_rows_grow_apart_decodes_each_as_alone(tiny, rand):
    """Configuration (d): two rows that grow to different lengths (the shorter one padded) give the authors' batch
    canvases. Its forwards differ: here every row waits for the others at the end of each block (the loop's rows
    share the current block), theirs move on at once (a cursor per row), so a batch may take more forwards (never
    fewer); alone, each row takes theirs (the test above)."""
    params, block = CONFIGS["a"]
    for model, prompts in ((tiny[0], tiny[2]), (rand, RANDOM_IDS)):
        canvases, nfe, *_ = reference_daedal(model, prompts, **reference_args(params, block))
        got, got_nfe = ours(model, prompts, Daedal(**params), block)
        assert got == canvases and got_nfe >= nfe
    assert len({len(c) for c in ours(tiny[0], tiny[2], Daedal(**params), block)[0]}) == 2


def test_on_dream_it_grows_on_aligned_logits_as_on_llada(dream):
    """The authors run LLaDA only; on Dream (shifted logits, aligned by the model) the same rules apply to position
    i's logits, and the transcription run on Dream's aligned logits agrees."""
    model, ids = dream
    params, block = CONFIGS["a"]
    for prompt in ids:
        canvas, nfe, *_ = reference_daedal(model, [prompt], **reference_args(params, block))
        assert ours(model, [prompt], Daedal(**params), block) == ([canvas[0]], nfe)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("disabled", [
    dict(initial_gen_length=32, max_gen_length=32, eos_check_tokens=1),  # no room to grow
    dict(initial_gen_length=32, eos_threshold=0.0, low_threshold=0.0, eos_check_tokens=1),  # no reason to grow
])
def test_with_its_growth_off_it_is_the_base_sampler_at_that_length(tiny, disabled, temperature):
    """No growth and no EOS tail (eos_check_tokens 1: none): the base sampler's tokens at gen_length 32, drawing the
    same random numbers, with one more forward (the stage-1 forward that finds nothing to grow)."""
    model, tok, _ = tiny
    texts = TEXTS + ["sort: 42,07,19,03", "copy: k3x9a"]
    args = dict(sampler="threshold", block_length=8, temperature=temperature, seed=[3, 4, 5, 6])
    base = dllm.generate(model, tok, texts, gen_length=32, **args)
    auto = dllm.generate(model, tok, texts, gen_length=Daedal(**disabled), **args)
    assert auto.canvas_ids == base.canvas_ids and auto.token_ids == base.token_ids
    assert auto.stats.nfe == base.stats.nfe + 1


@pytest.mark.parametrize("sampler", [cls.name for cls in samplers.SAMPLERS if cls.canvas_may_grow])
def test_every_sampler_that_lets_the_canvas_grow_decodes_a_padded_batch_as_each_prompt_alone(tiny, sampler):
    """Prompts of different lengths (left padding) whose answers grow apart, each row with its own random stream:
    every row's canvas and answer are its prompt's alone."""
    model, tok, _ = tiny
    texts = ["add: 0457+0168", "copy: k3x9a", "sort: 42,07,19,03"]
    args = dict(sampler=sampler, gen_length=Daedal(**dict(SMALL, low_threshold=0.5)), block_length=4,
                temperature=0.5)
    batch = dllm.generate(model, tok, texts, seed=[1, 2, 3], **args)
    assert len({len(c) for c in batch.canvas_ids}) > 1
    for i, text in enumerate(texts):
        alone = dllm.generate(model, tok, [text], seed=i + 1, **args)
        assert (alone.canvas_ids, alone.token_ids) == ([batch.canvas_ids[i]], [batch.token_ids[i]])


def test_log_probabilities_move_with_inserted_masks(tiny):
    """Every answer token keeps the log-probability it was committed with while masks are inserted before it (greedy:
    its own distribution's most probable token is itself), as its prompt alone (float32 layouts: 1e-4)."""
    model, tok, _ = tiny
    args = dict(gen_length=Daedal(**CONFIGS["b_forced_insertions"][0]), block_length=4, logprobs=1)
    batch = dllm.generate(model, tok, TEXTS, **args)
    for i, text in enumerate(TEXTS):
        got = batch.logprobs[i]
        assert [t.token for t in got] == [t.top[0][0] for t in got] == batch.token_ids[i]
        assert all(-30 < t.logprob == t.top[0][1] <= 0 for t in got)
        alone = dllm.generate(model, tok, [text], **args).logprobs[0]
        assert [t.token for t in alone] == batch.token_ids[i]
        assert [t.logprob for t in alone] == pytest.approx([t.logprob for t in got], abs=1e-4)


def test_settings_and_the_effective_token_ratio(tiny, tmp_path):
    """gen_length auto through settle (the sampler defaults to DAEDAL's fill rule), generate's max_gen_length, and
    eval's records: each answer's canvas and its tokens that are not EOS, their ratio in the summary."""
    from dllm.engine.options import settle
    from dllm.eval.harness import evaluate

    model, tok, _ = tiny
    settings = settle(model, gen_length="auto", length_args={"max_gen_length": "40", "initial_gen_length": 16})
    assert settings.sampler.name == "threshold"
    assert settings.lengths["gen_length"] == Daedal(initial_gen_length=16, max_gen_length=40)
    explained = settings.explain()["settings"]
    assert explained["gen_length"]["value"] == "auto" and explained["length.max_gen_length"]["from"] == "caller"
    assert explained["length.expansion_factor"] == {"value": 8, "from": "DAEDAL's paper"}
    out = dllm.generate(model, tok, TEXTS, gen_length="auto", max_gen_length=72, block_length=8)
    assert all(64 <= len(c) <= 72 for c in out.canvas_ids)
    summary = evaluate(model, tok, "synthetic", gen_length="auto", length_args={"initial_gen_length": 16,
                       "max_gen_length": 40}, block_length=8, limit=4, batch_size=2, output=tmp_path)
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert summary["config"]["gen_length"] == "auto" and summary["config"]["length"]["initial_gen_length"] == 16
    assert all(r["gen_tokens"] < r["effective_tokens"] <= r["canvas_tokens"] <= 40 for r in records)
    assert summary["effective_token_ratio"] == sum(r["effective_tokens"] for r in records) / sum(
        r["canvas_tokens"] for r in records)
    fixed = evaluate(model, tok, "synthetic", gen_length=32, block_length=8, limit=4, batch_size=2)
    assert fixed["canvas_tokens_mean"] == 32


@pytest.mark.parametrize("sampler", [cls.name for cls in samplers.SAMPLERS if not cls.canvas_may_grow])
def test_every_other_sampler_is_refused_in_one_line(tiny, sampler):
    from dllm.engine.options import settle

    with pytest.raises(DllmError, match=f"gen_length auto \\(DAEDAL\\) inserts masks between the steps of sampler "
                                        f"'{sampler}', which keeps state per position or plans ahead; use one of "
                                        f"low_confidence, threshold, factor, localleap, eb_sampler$"):
        settle(tiny[0], sampler, gen_length="auto")


@pytest.mark.parametrize("kwargs,message", [
    (dict(cache="dual"), "moves the columns whose keys and values cache 'dual' keeps"),
    (dict(compile=True), "changes the canvas's width as it grows"),
    (dict(logits_eos_inf=True), "logits_eos_inf bans EOS"),
    (dict(steps=32), "gen_length auto chooses the answer's length while decoding; drop steps"),
    (dict(max_gen_length=4), "initial_gen_length (64) exceeds max_gen_length (4); lower it"),
])
def test_what_cannot_grow_is_refused_in_one_line(tiny, kwargs, message):
    model, tok, _ = tiny
    with pytest.raises(DllmError, match=message.replace("(", r"\(").replace(")", r"\)")):
        dllm.generate(model, tok, TEXTS[:1], gen_length="auto", **kwargs)


@pytest.mark.parametrize("preset,message", [("sdar-tiny", "whose keys and values sdar fixes once decoded "
                                                          "(block-causal attention)"),
                                            ("wedlm-tiny", "(causal attention)"),
                                            ("diffusion-gemma-tiny", "is a uniform-state model")])
def test_models_it_cannot_grow_on_are_refused(preset, message):
    model = random_model(preset)
    sampler = "threshold" if model.config.mask_id is not None else "entropy_bound"
    with pytest.raises(DllmError, match=re.escape(message)):
        decoded(model, [[5, 6, 7]], samplers.SAMPLERS.create(sampler), caches.CACHES.create("none"), Daedal(), 4)


@pytest.mark.parametrize("gen_length,length_args,message", [
    ("long", None, "gen_length must be a number of answer tokens or 'auto', got 'long'"),
    (32, {"max_gen_length": 64}, "max_gen_length sets how gen_length auto grows an answer; add gen_length='auto'"),
    ("auto", {"factor": 2}, "unknown parameter 'factor' for gen_length auto"),
    ("auto", {"eos_threshold": -1}, "length policy 'daedal' parameter eos_threshold=-1.0 is out of range"),
])
def test_bad_length_settings_are_refused_in_one_line(tiny, gen_length, length_args, message):
    from dllm.engine.options import settle

    with pytest.raises(DllmError, match=message):
        settle(tiny[0], gen_length=gen_length, length_args=length_args)


def test_the_cli_grows_answers_and_refuses_commands_of_fixed_lengths(capsys):
    from dllm.cli import main

    assert main(["generate", "--gen-length", "auto", "--max-gen-length", "40", "--length-arg", "initial_gen_length=16",
                 "--json", "reverse: abc12"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["settings"]["gen_length"]["value"] == "auto" and out["settings"]["sampler"]["value"] == "threshold"
    assert out["settings"]["length.initial_gen_length"] == {"value": 16, "from": "caller"}
    assert out["outputs"][0]["text"] == "#### 21cba"
    assert main(["bench", "--gen-length", "auto"]) == 2
    assert "dllm bench times decoding at one answer length, and --gen-length auto" in capsys.readouterr().err
    assert main(["serve", "--max-gen-length", "64"]) == 2
    assert "dllm serve batches requests between blocks at fixed answer lengths" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--gen-length", "some", "x"])
    assert "expects a number of tokens or auto, got 'some'" in capsys.readouterr().err


def test_the_lm_eval_adapter_refuses_it_in_one_line():
    from dllm.eval.lm_eval_model import DllmLM

    with pytest.raises(DllmError, match="this adapter sizes each canvas from lm-eval's max_gen_toks; give gen_length=N"):
        DllmLM(model="tiny-llada", gen_length="auto")


def test_a_stream_gives_generates_answer_block_by_block(tiny):
    """Text already streamed never changes: masks are inserted at or after the current block."""
    model, tok, _ = tiny
    args = dict(gen_length=Daedal(**dict(SMALL, low_threshold=0.5)), block_length=4)
    for text in TEXTS:
        stream = dllm.stream(model, tok, text, **args)
        pieces = list(stream)
        want = dllm.generate(model, tok, [text], **args)
        assert "".join(pieces) == want.texts[0] and len(pieces) > 1
        assert stream.generation.token_ids == want.token_ids and stream.generation.stats.nfe == want.stats.nfe


def test_guided_rows_grow_as_each_prompt_alone(tiny):
    """Classifier-free guidance (the authors' cfg_scale): the EOS confidence and the insertions read the guided
    logits; each row of a padded batch is its prompt alone."""
    model, tok, _ = tiny
    texts = ["add: 0457+0168", "copy: k3x9a", "sort: 42,07,19,03"]
    args = dict(gen_length=Daedal(**dict(SMALL, max_gen_length=64, low_threshold=0.5)), block_length=4,
                cfg_scale=1.0, confidence_eos_eot_inf=True)
    batch = dllm.generate(model, tok, texts, **args)
    assert max(len(c) for c in batch.canvas_ids) > 32
    for i, text in enumerate(texts):
        assert dllm.generate(model, tok, [text], **args).canvas_ids == [batch.canvas_ids[i]]
