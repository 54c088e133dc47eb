"""Per-row sampler settings: rows of one batch with their own temperature, thresholds, ... (`Batch.add(...,
sampler=...)`, stacked into `[B]` tensors) give the tokens each prompt gives alone with its own settings."""
import functools
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import PC_TABLE, random_model

from dllm import cache as caches
from dllm import samplers
from dllm.core.errors import DllmError
from dllm.engine import Batch
from dllm.samplers import stack_rows
from dllm.samplers.entropy_bound import new_history, stops

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19], [20, 21]]
GEN, BLOCK = 16, 8
# a second value for every per-row parameter, far enough from the default to change what a random model decodes
OTHER = {"temperature": 0.7, "threshold": 0.1, "factor": 3.0, "top_p": 0.9, "top_k": 20, "eps": 0.1, "alg_temp": 0.5,
         "alpha": 1.5, "beta": 0.3, "gamma": 0.7, "relaxed_threshold": 0.05, "radius": 1, "early_threshold": 0.5,
         "mid_threshold": 0.3, "late_threshold": 0.1, "early_bound": 0.1, "late_bound": 0.5, "draft_steps": 2,
         "bound": 3.0, "sub_block": 3, "edit_threshold": 0.2, "edit_steps": 2, "delimiter_threshold": 0.2,
         "max_post_edit_steps": 1, "t_max": 1.2, "t_min": 0.3, "stability": 2, "confidence": 100.0,
         "base": 3, "skip": 2, "kl_threshold": 0.05, "history_length": 3, "position_decay": 1.0,
         "clip": 0.05, "low_threshold": 0.05,
         "remask_threshold": 0.05, "sigma": 2.0,
         "window_size": 4, "entropy_threshold": 100.0, "pos_penalty": 0.5}  # wedlm: fill the whole window
# settings every row shares: Prophet exits early (on the threshold rule), AdaBlock keeps fixed blocks (rows of one
# batch share block ends, so only then is each row its prompt alone), PC-Sampler's table (a random model has no
# directory), KLASS's thresholds within a random model's reach
SHARED = {"prophet": {"answer_start": 2, "base": "threshold"}, "adablock": {"delimiter_ids": "7",
                                                                            "delimiter_threshold": math.inf},
          "pc_sampler": PC_TABLE, "klass": {"threshold": 0.02, "kl_threshold": 1.0}}
FIXED = {"speculative": {"temperature"}, "adablock": {"delimiter_threshold"}}  # lossless only greedy; see above
PRESET = {"joint_threshold_indel": "llada2.2-tiny", "nemotron": "nemotron-diffusion-tiny",  # writes the delete and split tokens of an insert/delete model
          "entropy_bound": "diffusion-gemma-tiny",  # denoises a uniform-state canvas
          "klass": "dream-tiny",  # its top_p is Dream's (LLaDA's per-row settings: tests/test_klass.py)
          "wedlm": "wedlm-tiny"}  # its sliding window runs on a causal model
NAMES = [cls.name for cls in samplers.SAMPLERS]


def varied(name: str) -> list[str]:
    return [p for p in samplers.SAMPLERS.get(name).row_params() if p not in FIXED.get(name, ())]


@functools.cache
def model_for(name: str):
    model = random_model(PRESET.get(name, "llada-tiny"))
    if name == "entropy_bound":  # self-conditioning's output at transformers' initial scale: float32 rounding
        # differences between batch layouts stay far below what flips a sample (as in test_diffusion_gemma)
        with torch.no_grad():
            model.self_conditioning.mlp.down_proj.weight.mul_(0.2)
    return model


@pytest.fixture(scope="module")
def model():
    return model_for("low_confidence")


def decode_rows(model, rows: list[tuple[list[int], int, samplers.Sampler]]) -> list[list[int]]:
    """Each (prompt, seed, sampler) a row of one batch; their answers."""
    batch = Batch(model, rows[0][2], caches.CACHES.create("none"), BLOCK, BLOCK)
    added = [batch.add(prompt, GEN, seed, sampler) for prompt, seed, sampler in rows]
    while batch.running:
        batch.run_block()
    return [batch.answer(row) for row in added]


def mixed_and_alone(model, name: str, other: dict, shared: dict | None = None) -> tuple[list, list]:
    """Rows with the shared settings (default: `SHARED`'s) and with `other` in one batch (the first prompt with
    both), and each row alone."""
    shared = SHARED.get(name, {}) if shared is None else shared
    a = samplers.SAMPLERS.create(name, **shared)
    b = samplers.SAMPLERS.create(name, **{**shared, **other})
    rows = [(PROMPTS[0], 0, a), (PROMPTS[1], 1, b), (PROMPTS[0], 0, b), (PROMPTS[2], 2, a)]
    return decode_rows(model, rows), [decode_rows(model, [row])[0] for row in rows]


def test_every_per_row_parameter_has_a_second_value():
    missing = sorted({p for name in NAMES for p in varied(name)} - set(OTHER))
    assert not missing, f"add a second value for {missing} to OTHER"


@pytest.mark.parametrize("name", NAMES)
def test_two_settings_in_one_batch_equal_each_alone(name):
    """Every per-row parameter of the sampler differs between the two settings at once."""
    mixed, alone = mixed_and_alone(model_for(name), name, {p: OTHER[p] for p in varied(name)})
    assert mixed == alone
    assert alone[0] != alone[2]  # the second setting decodes the first prompt otherwise


@pytest.mark.parametrize("name,param", [(name, p) for name in NAMES for p in varied(name)])
def test_one_parameter_per_row_equals_alone(name, param):
    mixed, alone = mixed_and_alone(model_for(name), name, {param: OTHER[param]})
    assert mixed == alone


@pytest.mark.parametrize("name", ["low_confidence", "threshold", "leftmost"])
def test_causal_first_rows_with_their_own_settings_equal_each_alone(name):
    """Nemotron's causal first token (drawn at each row's own temperature), then the rule with each row's own
    parameters."""
    mixed, alone = mixed_and_alone(model_for("nemotron"), name, {p: OTHER[p] for p in varied(name)},
                                   {"causal_first": True})
    assert mixed == alone and alone[0] != alone[2]


def test_none_and_numbers_share_a_batch(model):
    """An optional parameter unset in some rows (top_p None) and set in others stacks as NaN, read as unset."""
    a, b = samplers.SAMPLERS.create("maskgit_plus", temperature=1.0), \
        samplers.SAMPLERS.create("maskgit_plus", temperature=1.0, top_p=0.5, top_k=3)
    stacked = stack_rows([a, b, a])
    assert stacked.top_p.isnan().tolist() == [True, False, True] and stacked.top_k[1] == 3
    assert stacked.temperature == 1.0 and stack_rows([a, a]) is a  # what rows share stays a number
    rows = [(PROMPTS[0], 3, a), (PROMPTS[0], 3, b)]
    assert decode_rows(model, rows) == [decode_rows(model, [row])[0] for row in rows]


def test_prophet_base_sampler_stacks_with_it():
    rows = [samplers.SAMPLERS.create("prophet", base="threshold", threshold=t) for t in (0.9, 0.3)]
    assert stack_rows(rows)._base.threshold.tolist() == [0.9, 0.3]


def test_adablock_rows_ask_for_their_own_block_ends():
    """Each row's delimiter threshold decides whether that row asks for the delimiter's end; the block ends at the
    smallest end any row asks for."""
    def end(taus):
        s = stack_rows([samplers.SAMPLERS.create("adablock", delimiter_ids="3", delimiter_threshold=t) for t in taus])
        logits = torch.full((2, 8, 5), -9.0)
        logits[:, :, 4] = 0.0
        logits[0, 2, 3] = logits[1, 5, 3] = 9.0  # row 0 confident of a delimiter at 2, row 1 at 5
        logits[1, 5, 3] = 0.5  # ... row 1 much less so
        ctx = samplers.StepContext(logits=logits, eligible=torch.ones(2, 8, dtype=torch.bool),
                                   masked=torch.ones(2, 8, dtype=torch.bool), positions=torch.arange(8),
                                   canvas=torch.zeros(2, 32, dtype=torch.long), step=0, steps=8, block=0,
                                   generators=[None, None], nfe=0, total_steps=8, block_start=0, block_end=8,
                                   prompt_length=0, state=SimpleNamespace())
        return s.block_end(ctx)
    assert end([0.9, 0.9]) == 3  # row 0 ends after its delimiter
    assert end([1.1, 0.5]) == 6  # row 0 asks for nothing; row 1's delimiter clears its threshold
    assert end([1.1, 0.9]) == 8  # nobody asks: the default block


def test_entropy_bound_rows_stop_by_their_own_stability_and_confidence():
    """entropy_bound's stop rule with per-row stability (the history as deep as the largest; a row compares its
    last `stability` canvases) and confidence: each row stops when it stops alone (a random model's canvases never
    settle, so the decode tests above cannot see this)."""
    settings = [(0, 1.0), (1, 9.0), (2, 9.0), (2, 1.5), (1, 0.5)]
    stacked = stack_rows([samplers.SAMPLERS.create("entropy_bound", stability=k, confidence=c) for k, c in settings])
    g = torch.Generator().manual_seed(0)
    argmaxes = torch.randint(0, 2, (8, len(settings), 2), generator=g)  # two tokens: canvases often repeat
    entropies = torch.rand((8, len(settings), 2), generator=g) * 3
    history, alone, seen = new_history(stacked.stability, argmaxes[0]), [None] * len(settings), []
    for argmax, entropy in zip(argmaxes, entropies):
        stop, history = stops(argmax, history, entropy, stacked.confidence, stacked.stability)
        for b, (k, c) in enumerate(settings):
            alone[b] = new_history(k, argmax[b:b + 1]) if alone[b] is None else alone[b]
            one, alone[b] = stops(argmax[b:b + 1], alone[b], entropy[b:b + 1], c)
            assert stop[b] == one[0]
        seen += stop.tolist()
    assert any(seen) and not all(seen)


def test_a_row_with_another_rule_is_refused(model):
    batch = Batch(model, samplers.SAMPLERS.create("factor"), caches.CACHES.create("none"), BLOCK, BLOCK)
    batch.add(PROMPTS[0], GEN, sampler=samplers.SAMPLERS.create("factor", factor=2.0))  # per row: fine
    for other in (samplers.SAMPLERS.create("factor", compat=True), samplers.SAMPLERS.create("threshold")):
        with pytest.raises(DllmError, match="more than its per-row parameters"):
            batch.add(PROMPTS[1], GEN, sampler=other)
