"""README's examples give the right answers: every `dllm generate` / `dllm chat` line of its shell blocks and its
first Python block run here, and each answer is checked against the synthetic suite's solution (the block's
`dllm.likelihood` must rank the right answer first)."""
import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import ROOT
from dllm.cli import build_parser, main
from dllm.eval.synthetic import extract_answer, solve

README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", README, re.S)
SHELL = [line for lang, body in BLOCKS if lang == "bash" for line in body.replace("\\\n", " ").splitlines()]
PIPED = re.compile(r"^(echo|printf) (.+?) \| (dllm .*)$")


def commands(verbs: tuple[str, ...]) -> list[str]:
    """Shell lines that run `dllm VERB` (after `&&`, or fed by `echo`/`printf`), comments stripped."""
    out = []
    for line in SHELL:
        line = line.split(" && ")[-1].strip()
        if any(re.search(rf"(^|\| )dllm {verb}\b", line) for verb in verbs):
            out.append(re.sub(r"\s+# .*$", "", line))
    return out


def run_line(line: str, monkeypatch, capsys) -> tuple[list[str], str]:
    """Run one README line in-process; returns the prompts it gives and what it prints."""
    stdin = ""
    piped = PIPED.match(line)
    if piped:
        feeder, text, line = piped.groups()
        text = shlex.split(text)[0]
        stdin = text.encode().decode("unicode_escape") if feeder == "printf" else text + "\n"
    argv = shlex.split(line)[1:]
    args = build_parser().parse_args(argv)
    prompts = getattr(args, "prompts", None) or [p for p in stdin.splitlines() if p.strip()]
    if getattr(args, "tensor_parallel", 1) > 1:  # its ranks in processes of their own, not this one's group
        done = subprocess.run([sys.executable, "-m", "dllm.cli", *argv], input=stdin, capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
        assert done.returncode == 0, done.stderr
        return prompts, done.stdout
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    assert main(argv) == 0
    return prompts, capsys.readouterr().out


@pytest.mark.parametrize("line", commands(("generate", "chat")))
def test_shell_example_answers_right(line, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)  # --trace files land here
    prompts, out = run_line(line, monkeypatch, capsys)
    if "--explain" in line:  # the settings and where they came from, no answer
        assert re.search(r"sampler = 'low_confidence' +\(dllm default\)", out) and "generation_config.json" in out
        assert "####" not in out  # README: it generates nothing
        return
    texts = [o["text"] for o in json.loads(out)["outputs"]] if "--json" in line else out.splitlines()
    assert [extract_answer(t) for t in texts] == [solve(p) for p in prompts], line


def test_there_are_examples_to_check():
    lines = commands(("generate", "chat"))
    assert len(lines) >= 6 and any("chat" in line for line in lines)


def test_python_example_answers_right(capsys):
    code = next(body for lang, body in BLOCKS if lang == "python")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        scope: dict = {}
        exec(code, scope)
    out = scope["out"]
    prompts = re.search(r"generate\(model, tok, (\[.*?\])", code, re.S)[1]
    assert [extract_answer(t) for t in out.texts] == [solve(p) for p in eval(prompts)]
    scores = scope["scores"]  # dllm.likelihood: the right answer is the likeliest
    assert max(scores, key=scores.get) == f"#### {solve('reverse: abc12')}" and len(scores) == 2
    streamed = scope["stream"].generation.texts[0]
    assert extract_answer(streamed) == solve(re.search(r"stream\(model, tok, (\".*?\")", code)[1].strip('"'))
    assert streamed in printed.getvalue()


@pytest.mark.parametrize("line", commands(("bench", "eval", "list")))
def test_other_examples_use_flags_that_exist(line):
    """The slow examples (bench on a 90M model, full evaluations, real checkpoints) are not run; their flags must
    still parse."""
    argv = shlex.split(line.split(" | ")[-1])
    start = argv.index("dllm") + 1 if "dllm" in argv else argv.index("dllm.cli") + 1
    build_parser().parse_args(argv[start:])


def test_the_diffusion_gemma_example_takes_the_forwards_it_says():
    """README's count for `dllm generate --model random:diffusion-gemma-tiny --no-chat "abc"` (it said 768 forwards,
    the limit, where the answer takes 432)."""
    line = re.search(r"`(dllm generate --model random:diffusion-gemma-tiny --no-chat \"abc\")` runs it on the CPU "
                     r"\((\d+) forwards and (\d+)\s+tokens", README)
    assert line, "the example and its count are missing from README.md"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(shlex.split(line[1])[1:] + ["--json"]) == 0
    stats = json.loads(printed.getvalue())["stats"]
    assert (stats["nfe"], stats["gen_tokens"]) == (int(line[2]), int(line[3]))
