"""The shipped tiny models: they load by name, decode held-out items correctly and deterministically, and show
the behaviour the sampler papers measure (threshold decoding: fewer forwards, same answers; speculative
decoding: the vanilla tokens with fewer forwards)."""
import pytest
import torch

import dllm
from dllm.cli import main
from dllm.eval.synthetic import make_split, score

HELD_OUT = make_split("test", 10)  # the first ten held-out items of every family (every shipped model learned them)


@pytest.fixture(scope="module", params=["tiny-llada", "tiny-dream", "tiny-sdar"])
def shipped(request):
    return dllm.load(request.param)


@pytest.fixture
def fast_cache(shipped):
    """Fast-dLLM's dual cache, or on a block-causal model its exact finished-block cache."""
    return "block" if shipped[0].config.block_size else "dual"


def answers(model, tok, **kwargs):
    """Blocks of the model's default: 32, or a block-causal model's attention block (tiny-sdar: 4)."""
    return dllm.generate(model, tok, [ex.prompt for ex in HELD_OUT], gen_length=64, **kwargs)


def assert_solved(texts):
    """At least 90% right overall and 6 of 10 in every family (RESULTS.md: 96-99% on 1000 items, sort 84-97%)."""
    right = {}
    for ex, text in zip(HELD_OUT, texts):
        right.setdefault(ex.family, []).append(score(ex, text))
    wrong = [(ex.prompt, text) for ex, text in zip(HELD_OUT, texts) if not score(ex, text)]
    assert len(wrong) <= len(HELD_OUT) // 10 and all(sum(r) >= 6 for r in right.values()), wrong


def test_vanilla_decoding_solves_held_out_items(shipped):
    assert_solved(answers(*shipped).texts)


def test_decoding_is_deterministic(shipped, fast_cache):
    assert answers(*shipped, cache=fast_cache).token_ids == answers(*shipped, cache=fast_cache).token_ids


def test_threshold_decoding_keeps_the_answers_with_fewer_forwards(shipped, fast_cache):
    """At least 2 tokens per forward, or on a block-causal model (tiny-sdar: at most its 4-token block per
    forward) under half of vanilla decoding's forwards."""
    fast = answers(*shipped, sampler="threshold", cache=fast_cache, threshold=0.9)
    assert_solved(fast.texts)
    if shipped[0].config.block_size:
        assert fast.stats.nfe * 2 < answers(*shipped, cache=fast_cache).stats.nfe
    else:
        assert fast.stats.tpf >= 2.0


@pytest.mark.parametrize("cached", [False, True])
def test_speculative_is_vanilla_with_fewer_forwards(shipped, fast_cache, cached):
    model, tok = shipped
    prompts = [ex.prompt for ex in HELD_OUT[::10]]  # one item per family
    args = dict(gen_length=64, cache=fast_cache if cached else "none", stop_early=False)
    vanilla = dllm.generate(model, tok, prompts, **args)
    fast = dllm.generate(model, tok, prompts, sampler="speculative", draft_steps=4, **args)
    assert torch.equal(fast.sequences, vanilla.sequences)
    assert fast.stats.nfe < vanilla.stats.nfe


def test_cli_default_model_is_tiny_llada(capsys):
    assert main(["generate", HELD_OUT[0].prompt, "--json"]) == 0
    assert HELD_OUT[0].answer in capsys.readouterr().out


def test_cli_chat_answers_each_turn(monkeypatch, capsys):
    import io
    lines = f"{HELD_OUT[0].prompt}\ncopy: K\n{HELD_OUT[2].prompt}\n\nnot read\n"  # K: not in the vocabulary
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    assert main(["chat", "--sampler", "threshold", "--cache", "dual"]) == 0
    out = capsys.readouterr()
    first, second = out.out.splitlines()  # one line per turn; stops at the empty line
    assert [first, second] == [HELD_OUT[0].answer, HELD_OUT[2].answer]  # single-turn model: each turn afresh
    assert out.err == "error: prompt 0 has characters the tokenizer does not know: 'K'; remove or replace them\n"
    assert main(["chat", "--no-chat"]) == 2


@pytest.mark.parametrize("sampler,cache", [("low_confidence", None), ("threshold", "fast"),
                                           ("speculative", "fast")])
def test_stream_gives_the_answer_block_by_block_while_decoding(shipped, fast_cache, sampler, cache):
    """`dllm.stream`: the texts it yields add up to `generate`'s answer for the prompt alone (tokens and forwards
    the same), and the first arrives before the decoding ends (a text per decoded block, not one at the end)."""
    model, tok = shipped
    cache = fast_cache if cache == "fast" else cache
    size = model.config.block_size or 8
    for ex in HELD_OUT[::10]:
        steps = []
        s = dllm.stream(model, tok, ex.prompt, sampler, cache, gen_length=64, block_length=size,
                        callback=lambda info: steps.append(info))
        deltas, steps_at = [], []
        for text in s:
            deltas.append(text)
            steps_at.append(len(steps))
        alone = dllm.generate(model, tok, [ex.prompt], sampler, cache, gen_length=64, block_length=size)
        assert "".join(deltas) == s.generation.texts[0] == alone.texts[0]
        assert s.generation.token_ids == alone.token_ids and s.generation.stats.nfe == alone.stats.nfe
        assert torch.equal(s.generation.sequences, alone.sequences)
        assert len(deltas) > 1 and steps_at[0] < len(steps)


@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream"])
def test_stream_of_an_answer_filled_early_is_whole(name):
    """Prophet fills every later block in one forward and the row finishes inside the first block: the stream
    still gives the whole answer."""
    model, tok = dllm.load(name)
    prompt = "add: 0457+0168"
    args = dict(gen_length=64, block_length=16, answer_start=5)  # the answer follows "#### "
    s = dllm.stream(model, tok, prompt, "prophet", **args)
    alone = dllm.generate(model, tok, [prompt], "prophet", **args)
    assert "".join(s) == s.generation.texts[0] == alone.texts[0] and alone.texts[0].endswith("#### 625")
    assert s.generation.token_ids == alone.token_ids


def test_stream_holds_a_character_split_between_blocks_back(monkeypatch):
    """A block that ends inside a character (byte-level BPE: the decoded text ends in U+FFFD) gives no text
    until the next block completes the character."""
    model, tok = dllm.load("tiny-llada")
    prompt = "copy: k3j9x7q2m8"  # "#### k3j" | "9x7q2m8" and the stop: two blocks of 8
    decode = type(tok).decode
    monkeypatch.setattr(type(tok), "decode", lambda self, ids, **kw: decode(self, ids, **kw)[:-1] + "\ufffd"
                        if len(ids) == 8 else decode(self, ids, **kw))
    assert list(dllm.stream(model, tok, prompt, "threshold", "dual", block_length=8)) == ["#### k3j9x7q2m8"]


def test_stream_takes_one_prompt():
    model, tok = dllm.load("tiny-llada")
    with pytest.raises(dllm.DllmError, match="stream takes one prompt .* use generate for a batch"):
        dllm.stream(model, tok, ["copy: ab", "copy: cd"])
