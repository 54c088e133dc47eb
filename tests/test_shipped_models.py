"""The shipped tiny models: they load by name, decode held-out items correctly and deterministically, and show
the behaviour the sampler papers measure (threshold decoding: fewer forwards, same answers; speculative
decoding: the vanilla tokens with fewer forwards)."""
import pytest
import torch

import dllm
from dllm.cli import main
from eval.synthetic import make_split, score

# Families each model has learned (RESULTS.md has every family); the tests decode their first held-out items.
LEARNED = {"tiny-llada": ("copy", "reverse", "count", "add"), "tiny-dream": ("copy", "reverse", "sort", "count", "add")}


def held_out(name: str) -> list:
    return [ex for f in LEARNED[name] for ex in make_split("test", 2, families=[f])]


HELD_OUT = held_out("tiny-llada")


@pytest.fixture(scope="module", params=list(LEARNED))
def shipped(request):
    model, tok = dllm.load(request.param)
    return model, tok, held_out(request.param)


def answers(model, tok, items, **kwargs):
    return dllm.generate(model, tok, [ex.prompt for ex in items], gen_length=64, block_length=32, **kwargs)


def test_vanilla_decoding_is_correct(shipped):
    out = answers(*shipped)
    assert [score(ex, text) for ex, text in zip(shipped[2], out.texts)] == [True] * len(shipped[2]), out.texts


def test_decoding_is_deterministic(shipped):
    assert answers(*shipped, cache="dual").token_ids == answers(*shipped, cache="dual").token_ids


def test_threshold_decoding_keeps_the_answers_with_fewer_forwards(shipped):
    fast = answers(*shipped, sampler="threshold", cache="dual", threshold=0.9)
    assert [score(ex, text) for ex, text in zip(shipped[2], fast.texts)] == [True] * len(shipped[2]), fast.texts
    assert fast.stats.tpf >= 2.0


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_speculative_is_vanilla_with_fewer_forwards(shipped, cache):
    model, tok, items = shipped
    prompts = [ex.prompt for ex in items[::2]]  # one item per family
    args = dict(gen_length=64, block_length=32, cache=cache, stop_early=False)
    vanilla = dllm.generate(model, tok, prompts, **args)
    fast = dllm.generate(model, tok, prompts, sampler="speculative", draft_steps=4, **args)
    assert torch.equal(fast.sequences, vanilla.sequences)
    assert fast.stats.nfe < vanilla.stats.nfe


def test_cli_default_model_is_tiny_llada(capsys):
    assert main(["generate", HELD_OUT[0].prompt, "--json"]) == 0
    assert HELD_OUT[0].answer in capsys.readouterr().out


def test_cli_chat_answers_each_turn(monkeypatch, capsys):
    import io
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{HELD_OUT[0].prompt}\n{HELD_OUT[2].prompt}\n\nnot read\n"))
    assert main(["chat", "--sampler", "threshold", "--cache", "dual"]) == 0
    first, second = capsys.readouterr().out.splitlines()  # one line per turn; stops at the empty line
    assert first == HELD_OUT[0].answer  # (tiny-llada was trained on single turns only: the second is not scored)
