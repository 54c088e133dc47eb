"""Every bad input a newcomer tried (issue #14): one `error:` line that names the fix, exit 2, nothing half-written.

Each row is an input that used to give a traceback or a silent wrong result; the pattern is the part of the
message that names what to do."""
import io
import json
import re

import pytest
import torch

import dllm
from dllm.cli import main
from dllm.core.errors import DllmError
from dllm.engine.options import decoding_lengths

TINY = ["--model", "random:llada-tiny"]
LONG_PROMPT = "a" * 600  # over random:llada-tiny's 512-token context


class _Stdin:
    """A stand-in for sys.stdin whose bytes are given."""

    def __init__(self, data: bytes):
        self.buffer = io.BytesIO(data)

    def isatty(self) -> bool:
        return False


def cli(argv, capsys, monkeypatch, stdin: bytes | None = None) -> tuple[int, str]:
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", _Stdin(stdin))
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    return code, capsys.readouterr().err


# argv (with {tmp} for the test's folder), pattern, stdin bytes, paths under {tmp} that must not exist afterwards
CLI_CASES = [
    (["generate", "copy: abcd", "--device", "cuda"], "CUDA is not available.*use --device cpu", None, []),
    (["generate", "copy: abcd", "--device", "tpu"], "unknown device 'tpu'; use cpu, cuda", None, []),
    (["generate", "copy: abcd", "--device", "cuda:7"], "CUDA is not available|there is no cuda:7", None, []),
    (["generate", "copy: abcd", "--dtype", "int8"], "unsupported dtype 'int8'; use one of float32", None, []),
    (["generate", "copy: abcd", "--trace", "{tmp}"], "--trace .* is a directory; give a file name", None, []),
    (["generate", "copy: abcd", "--trace", ""], "--trace needs a file name", None, []),
    (["generate", "copy: abcd", "--trace", "{tmp}/no/t.jsonl"], "folder .* does not exist; create it", None, []),
    (["generate", "copy: abcd", "--trace", "/proc/self/t.jsonl"], "--trace /proc/self/t.jsonl is not writable", None,
     []),
    (["generate", LONG_PROMPT, "--no-chat", "--trace", "{tmp}/t.jsonl"], "exceeds the model's context.*lower gen_length",
     None, ["t.jsonl"]),
    (["generate"], "line 1 of standard input is not UTF-8.*iconv", b"copy: ab\xff\n", []),
    (["generate"], "no prompt given; pass PROMPT arguments or pipe prompts", b"\n\n", []),
    (["generate", ""], "prompt 0 is empty; give some text", None, []),
    (["generate", "   "], "prompt 0 is empty", None, []),
    (["generate", "COPY: \u00c4B"], "characters the tokenizer does not know: .*'\u00c4'.*remove or replace", None, []),
    (["generate", "x", "--gen-length", "48.5"],
     "argument --gen-length: expects a number of tokens or auto, got '48.5'; see `dllm generate", None, []),
    (["generate", "x", "--gen-length", "48", "--block-length", "32"],
     r"multiple of block_length \(32\); e.g. gen_length 32 or block_length 48",
     None, []),
    (["generate", "x", "--gen-length", "0"], "must be positive", None, []),
    (["generate", "x", "--gen-length", "32", "--steps", "64"], r"steps \(64\) must be .* between 1 and gen_length", None,
     []),
    (["generate", "x", "--temperature", "inf"], "temperature must be finite, got inf", None, []),
    (["generate", "x", "--temperature", "-1"], "temperature=-1.0 is out of range; it must be >= 0", None, []),
    (["generate", "x", "--sampler", "nope"], "unknown sampler 'nope'; choose one of", None, []),
    (["generate", "x", "--cache", "xyz"], "unknown cache 'xyz'; choose one of none, prefix, dual", None, []),
    (["generate", "x", "--cache", "nope"], "unknown cache 'nope'; did you mean 'none'[?]", None, []),
    (["generate", "x", "--sampler-arg", "threshold=0.5"], "unknown parameter 'threshold' for sampler 'low_confidence'",
     None, []),
    (["generate", "x", "--sampler", "threshold", "--sampler-arg", "threshold=yes"], "threshold must be float", None, []),
    (["generate", "x", "--cache", "elastic", "--cache-arg", "gamma=nan"], "gamma must be a number, got nan", None, []),
    (["generate", "x", "--cache", "dual", "--cache-arg", "refresh_every=1.5"], "refresh_every must be int", None, []),
    (["generate", "x", "--cache-arg", "refresh_every=2"], "--cache-arg refresh_every=2 needs --cache NAME", None, []),
    (["generate", "x", "--sampler-arg", "temperature"], "--sampler-arg expects KEY=VALUE", None, []),
    (["generate", "x", "--sampler", "speculative", "--cache", "dkv"],
     r"use cache none, prefix, dual or \(block-causal models\) block", None, []),
    (["generate", "x", "--model", "no-such-model"],
     "unknown model 'no-such-model'; choose one of tiny-dgemma, tiny-dream, ", None, []),
    # a name close to known ones names them alone (issue #39)
    (["generate", "x", "--sampler", "thresh"], r"unknown sampler 'thresh'; did you mean 'threshold'\? \(`dllm list",
     None, []),
    (["generate", "x", "--sampler", "low-confidence"], "did you mean 'low_confidence'[?] [(]", None, []),
    (["generate", "x", "--cache", "dkv-greedy"], "unknown cache 'dkv-greedy'; did you mean 'dkv_greedy'[?] [(]", None,
     []),
    (["generate", "x", "--model", "tiny-lada"], "unknown model 'tiny-lada'; did you mean 'tiny-llada'[?] [(]or give",
     None, []),
    (["generate", "x", "--model", "random:llada-smal"], "did you mean 'random:llada-small'[?]$", None, []),
    (["eval", "--task", "gsm8", "--gold"], "unknown task 'gsm8'; did you mean 'gsm8k'[?]$", None, []),
    (["generate", "x", "--model", "/nope/LLaDA-8B-Instruct"],
     "^error: no such directory /nope/LLaDA-8B-Instruct; give a local checkpoint directory", None, []),
    (["generate", "x", "--sampler", "prophet", "--sampler-arg", "answer_start=64"],
     "answer_start=64 is past the answer [(]64 tokens, gen_length[)].*give an offset below 64", None, []),
    (["bench", "--sampler", "prophet", "--sampler-arg", "answer_start=70", "--gen-length", "32"],
     "answer_start=70 is past the answer [(]32 tokens", None, []),
    (["eval", "--sampler", "prophet", "--sampler-arg", "answer_start=16", "--gen-length", "16", "--output",
      "{tmp}/out"], "answer_start=16 is past the answer", None, ["out"]),
    (["generate", "x", "--model", "{tmp}"], "has no config.json; point at a Hugging Face model directory", None, []),
    (["bench", "--repeats", "0"], "--repeats must be at least 1", None, []),
    (["bench", "--batch-size", "0"], "--batch-size must be at least 1", None, []),
    (["bench", "--batch-size", "1,0"], "--batch-size must be at least 1, got 0", None, []),
    (["bench", "--batch-size", "1;8"], "--batch-size takes an integer or comma-separated integers, e.g. 1,8", None,
     []),
    (["bench", "--prompt-length", "0"], "--prompt-length must be at least 1", None, []),
    (["eval", "--limit", "0"], "limit must be at least 1, got 0", None, []),
    (["eval", "--limit", "-5"], "limit must be at least 1, got -5", None, []),
    (["eval", "--batch-size", "0"], "batch_size must be at least 1", None, []),
    (["eval", "--task", "nope"], "unknown task 'nope'; choose one of synthetic", None, []),
    (["eval", "--num-fewshot", "2"], "synthetic is evaluated zero-shot; use --num-fewshot 0", None, []),
    (["eval", "--task", "gsm8k", "--num-fewshot", "7474"], "gsm8k has .* few-shot examples; use --num-fewshot", None, []),
    (["eval", "--output", "{tmp}/file"], "--output .*file is a file; give a directory", None, []),
    (["eval", "--output", "/proc/self/out"], "--output /proc/self/out is not writable", None, []),
    (["eval", "--output", "{tmp}/out", "--gen-length", "512", "--block-length", "512"],
     "exceeds the model's context.*lower --num-fewshot.*or --gen-length, or use a model with a longer context", None,
     ["out"]),
    (["eval", "--task", "gsm8k", "--model", "tiny-llada", "--limit", "2", "--output", "{tmp}/gsm"],
     "tokenizer cannot read the task's prompts.*use a model whose vocabulary covers the task", None, ["gsm"]),
    (["eval", "--sweep", "sampler=threshold"], "--sweep needs --output DIR", None, []),
    (["eval", "--cache", "dkv", "--compile", "--output", "{tmp}/out"],
     "cache 'dkv' chooses its rows token by token and runs eagerly; drop --compile", None, ["out"]),
    (["eval", "--gold", "--sweep", "sampler=threshold"], "--gold scores the references without a model; drop --sweep",
     None, []),
    (["chat"], "line 1 of standard input is not UTF-8", b"\xfe\xff\n", []),
    (["list", "widgets"], "argument what: invalid choice: 'widgets'", None, []),
]


@pytest.mark.parametrize("argv,pattern,stdin,absent", CLI_CASES, ids=lambda v: None)
def test_cli_bad_input_is_one_error_line(argv, pattern, stdin, absent, tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("not a directory")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if "--model" not in argv and argv[0] in ("generate", "chat", "bench", "eval"):
        argv += TINY
    code, err = cli(argv, capsys, monkeypatch, stdin)
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert re.search(pattern, err), err
    for name in absent:
        assert not (tmp_path / name).exists(), f"{name} was left behind"


@pytest.fixture(scope="module")
def tiny():
    return dllm.load("random:llada-tiny")


# keyword arguments of dllm.generate (on random:llada-tiny, prompt "hi" unless given), pattern
API_CASES = [
    (dict(prompts=None), "prompts must be a string or a non-empty list"),
    (dict(prompts=[]), "prompts must be a string or a non-empty list"),
    (dict(prompts=[123]), r"prompt 0 is 123; a prompt is a string or a list of token ids .*\[\[1, 2, 3\]\]"),
    (dict(prompts=["ok", 4.5]), "prompt 1 is 4.5"),
    (dict(prompts=[[1, 2, 9999]]), r"token id 9999, outside the model's vocabulary \[0, 128\)"),
    (dict(prompts=[[-1, 5]]), "token id -1, outside the model's vocabulary"),
    (dict(prompts=[[]]), "prompt 0 is empty"),
    (dict(prompts=["caf\udcff"]), "prompt 0 is not valid UTF-8"),
    (dict(prompts=["copy: ab<|eot_id|>x"], chat=True),
     "prompt 0 contains the special token '<|eot_id|>', which the chat template would read as a control token"),
    (dict(gen_length="64"), "gen_length must be a number of answer tokens or 'auto', got '64'"),
    (dict(gen_length=48.5), "gen_length must be an integer, got 48.5"),
    (dict(gen_length=True), "gen_length must be an integer, got True"),
    (dict(block_length=8.0), "block_length must be an integer"),
    (dict(steps="all"), "steps must be an integer"),
    (dict(seed="abc"), "seed must be an integer, got 'abc'"),
    (dict(chat="no"), "chat must be True, False or None"),
    (dict(stop_early="yes"), "stop_early must be True or False"),
    (dict(temperature=float("inf")), "temperature must be finite, got inf"),
    (dict(temperature=float("nan")), "temperature must be a number, got nan"),
    (dict(sampler="threshold", threshold=True), "threshold must be float, got True"),
    (dict(cache="elastic", gamma=float("nan"), sampler="threshold"), "gamma must be a number, got nan"),
    (dict(sampler="credit", cache="elastic", gamma=0.5), "'gamma' is taken by both sampler 'credit' and cache "
                                                         "'elastic'; say which with sampler_args=.* or cache_args="),
    (dict(sampler="factor", compat=2), "compat must be bool, got 2"),
    (dict(gen_length=1024, block_length=32), "exceeds the model's context of 512; shorten the prompt"),
]


@pytest.mark.parametrize("kwargs,pattern", API_CASES, ids=lambda v: None)
def test_api_bad_input_is_one_line_error(tiny, kwargs, pattern):
    kwargs = {"prompts": ["hi"], "chat": False, **kwargs} if "chat" not in kwargs else {"prompts": ["hi"], **kwargs}
    with pytest.raises(DllmError, match=pattern) as info:
        dllm.generate(*tiny, **kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("call", ["generate", "stream"])
def test_token_ids_outside_the_vocabulary_are_refused_before_any_decodes_them(call):
    """On a model whose generation config names prompt formats (the shipped tiny ones), prompts are decoded to text
    for the format check: a negative id is refused before, as an id past the vocabulary is (it was an OverflowError
    from the tokenizer)."""
    model, tok = dllm.load("tiny-llada")
    for ids, bad in (([-1, 5], -1), ([5, 10**6], 10**6)):
        with pytest.raises(DllmError, match=f"prompt 0 has token id {bad}, outside the model's vocabulary"):
            getattr(dllm, call)(model, tok, [ids] if call == "generate" else ids, chat=False)


@pytest.mark.parametrize("args,pattern", [
    ((None,), "model must be a name or a directory, got None"),
    (("random:llada-tiny", 123), "device must be a string such as 'cpu' or 'cuda', got 123"),
    (("random:llada-tiny", "cpu", torch.int8), "unsupported dtype torch.int8"),
    (("random:llada-tiny", "cpu", "int4"), "unsupported dtype 'int4'"),
])
def test_load_bad_input_is_one_line_error(args, pattern):
    with pytest.raises(DllmError, match=pattern) as info:
        dllm.load(*args)
    assert "\n" not in str(info.value)


def test_ambiguous_parameter_goes_where_it_is_told(tiny):
    out = dllm.generate(*tiny, ["hi"], sampler="credit", cache="elastic", chat=False, gen_length=8, block_length=8,
                        sampler_args={"gamma": 0.5}, cache_args={"gamma": 0.8})
    assert out.sampler["gamma"] == 0.5 and out.cache["gamma"] == 0.8


def test_model_dir_without_tokenizer_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    model, _ = dllm.load("random:llada-tiny")
    dllm.save_pretrained(model, None, tmp_path)
    code, err = cli(["generate", "x", "--model", str(tmp_path)], capsys, monkeypatch)
    assert code == 2 and err.count("\n") == 1
    assert "has no tokenizer files (one of tokenizer.json" in err and "copy them from the original checkpoint" in err


def test_interrupted_eval_keeps_records_and_names_the_resume_command(tmp_path, capsys, monkeypatch):
    import dllm.eval.harness as harness

    real, calls = harness._decode_batch, []

    def interrupt_second_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(harness, "_decode_batch", interrupt_second_batch)
    monkeypatch.setattr("sys.argv", ["dllm", "eval", "--limit", "6"])
    argv = ["eval", *TINY, "--limit", "6", "--batch-size", "3", "--gen-length", "8", "--block-length", "8",
            "--output", str(tmp_path / "run")]
    code, err = cli(argv, capsys, monkeypatch)
    assert code == 130 and err.count("\n") == 1
    assert err.startswith("error: interrupted; 3 records kept in") and "rerun the same command to resume: dllm eval" \
        in err
    monkeypatch.setattr(harness, "_decode_batch", real)
    assert cli(argv, capsys, monkeypatch)[0] == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    assert len(records) == 6 and len({r["id"] for r in records}) == 6


@pytest.mark.parametrize("gen_length,block", [(64, 32), (16, 16), (48, 24), (100, 25), (96, 32)])
def test_gen_length_alone_picks_a_block_that_divides_it(tiny, gen_length, block):
    """Without block_length, blocks of 32 or the largest size below that divides gen_length (never an error)."""
    assert decoding_lengths(tiny[0], gen_length)["block_length"] == block


def test_generation_config_of_the_model_directory_wins(tmp_path):
    model, tok = dllm.load("random:llada-tiny")
    dllm.save_pretrained(model, tok, tmp_path)
    default = dllm.generate(model, tok, ["hi"], chat=False)
    assert default.sequences.shape[1] - 2 == 64  # ours: gen_length 64
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 16, "block_length": 8}))
    loaded, tok = dllm.load(str(tmp_path))
    out = dllm.generate(loaded, tok, ["hi"], chat=False, stop_early=False, trace=True)
    assert out.sequences.shape[1] - 2 == 16 and {s["block"] for s in out.trace} == {0, 1}
    assert dllm.generate(loaded, tok, ["hi"], chat=False, gen_length=32).sequences.shape[1] - 2 == 32  # caller wins
    (tmp_path / "generation_config.json").write_text(json.dumps({"steps": 512}))  # Dream's default, no length
    assert "steps" not in dllm.load(str(tmp_path))[0].generation_defaults.values  # not applied to our 64 tokens
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 16, "steps": 8}))
    assert dllm.load(str(tmp_path))[0].generation_defaults.values == {"gen_length": 16, "steps": 8}
    loaded = dllm.load(str(tmp_path))[0]  # the file's steps go with its length only
    assert decoding_lengths(loaded)["steps"] == 8 and decoding_lengths(loaded, 32)["steps"] is None
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 12, "block_length": 8}))
    loaded, tok = dllm.load(str(tmp_path))  # a bad layout from the file: the file is named
    with pytest.raises(DllmError, match=r"gen_length \(12\) must be a multiple of block_length \(8\).*"
                                        r"\(from the model's generation_config.json: max_new_tokens 12, "
                                        r"block_length 8\)"):
        dllm.generate(loaded, tok, ["hi"], chat=False)
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": "many"}))
    with pytest.raises(DllmError, match=r"generation_config.json: max_new_tokens must be a positive integer, got "
                                        r"'many'; fix or delete it"):  # the file's key, not ours (gen_length)
        dllm.load(str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"multi_turn": "no"}))
    with pytest.raises(DllmError, match="multi_turn must be true or false, got 'no'; fix or delete it"):
        dllm.load(str(tmp_path))


def test_chat_keeps_the_conversation_unless_the_model_answers_single_turns(tmp_path, capsys, monkeypatch):
    """tiny-llada declares multi_turn: false, so each turn decodes alone; --history sends the conversation."""
    import dllm.engine.api as engine

    seen = []
    real = engine.encode_prompts
    monkeypatch.setattr(engine, "encode_prompts", lambda tok, prompts, chat: seen.append(prompts[0]) or
                        real(tok, prompts, chat))
    for flags in ([], ["--history"]):
        seen.clear()
        assert cli(["chat", *flags], capsys, monkeypatch, b"copy: abcd\nreverse: abcd\n")[0] == 0
        assert ("copy: abcd" in seen[1]) == bool(flags) and "reverse: abcd" in seen[1]


def test_a_reader_that_leaves_early_gets_no_traceback():
    """`dllm ... | head`: when the pipe closes, the command stops quietly (exit 141, as a shell reports SIGPIPE)."""
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "dllm.cli", "list", "samplers"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()
    assert (proc.wait(timeout=120), proc.stderr.read()) == (141, b"")
