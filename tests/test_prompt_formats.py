"""The shipped tiny models name the prompts they were trained on (issue #39): a prompt outside them gets a one-line
notice, never an error, and one inside gets none."""
import json
import os
import re
import subprocess
import sys
import warnings

import pytest

import dllm
from conftest import ROOT
from dllm.cli import main
from dllm.core.errors import DllmError, DllmNotice
from dllm.eval import synthetic as S
from dllm.models.loading import SHIPPED_DIR, shipped_models

OUTSIDE = ["copy: abc", "copy: abcdefghijklm", "reverse: ab", "sort: 5,3", "sort: 01,02,03",
           "sort: 01,02,03,04,05,06,07,08,09", "count digits: 0123456789", "add: 1+2", "add: 0001+0002",
           "add: 12+34", "multiply: 0012+0034"]


def test_every_prompt_the_suite_draws_is_in_its_format_and_the_near_misses_are_not():
    examples = S.make_split("train", n_per_family=2000) + S.make_split("test")
    for ex in examples:
        assert re.fullmatch(S.PROMPT_FORMATS[ex.family], ex.prompt), ex
        assert sum(bool(re.fullmatch(f, ex.prompt)) for f in S.PROMPT_FORMATS.values()) == 1, ex
    for prompt in OUTSIDE:
        assert not any(re.fullmatch(f, prompt) for f in S.PROMPT_FORMATS.values()), prompt


@pytest.mark.parametrize("name", shipped_models())
def test_the_shipped_models_carry_their_training_format(name):
    config = json.loads((SHIPPED_DIR / name / "generation_config.json").read_text())
    families = S.LIST_FAMILIES if name == "tiny-llada-lists" else S.FAMILIES
    assert {k: config[k] for k in ("prompt_formats", "trained_on")} == S.training_format(families)


@pytest.fixture(scope="module")
def tiny():
    return dllm.load("tiny-llada")


def notices(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if issubclass(w.category, DllmNotice)]


def test_a_prompt_outside_the_format_gets_a_notice_and_one_inside_none(tiny):
    model, tok = tiny
    inside = [ex.prompt for ex in S.make_split("test", n_per_family=2)]
    assert notices(lambda: dllm.generate(model, tok, inside, sampler="threshold", cache="dual")) == []
    for prompt in OUTSIDE:
        said = notices(lambda: dllm.generate(model, tok, [prompt], sampler="threshold", cache="dual"))
        trained_on = S.training_format()["trained_on"]
        assert said == [f"{prompt!r} is outside the prompts this model was trained on ({trained_on}); expect wrong "
                        f"answers"]
    said = notices(lambda: dllm.generate(model, tok, [inside[0], "copy: abc", "add: 1+2"], gen_length=32))
    assert said[0].startswith("2 of 3 prompts (first: 'copy: abc') are outside the prompts")


def test_raw_text_needs_the_chat_template(tiny):
    """--no-chat sends text the model never saw (it answers ''); the template typed out by hand, as `dllm chat`
    and lm-eval's --apply_chat_template send it, is in the format."""
    model, tok = tiny
    said = notices(lambda: dllm.generate(model, tok, ["copy: abcd"], chat=False, gen_length=32))
    assert said[0].startswith("'copy: abcd' (not in the chat template) is outside")
    turn = tok.apply_chat_template([{"role": "user", "content": "copy: abcd"}], add_generation_prompt=True,
                                   tokenize=False)
    assert notices(lambda: dllm.generate(model, tok, [turn], chat=False, gen_length=32)) == []
    assert notices(lambda: dllm.stream(model, tok, "copy: ab", gen_length=32)) != []


def test_the_command_line_prints_one_note_line(capsys):
    def stderr(prompt: str) -> list[str]:
        run = subprocess.run([sys.executable, "-m", "dllm.cli", "generate", prompt], cwd=ROOT, capture_output=True,
                             text=True, env={**os.environ, "DLLM_THREADS": "1"}, timeout=120)
        assert run.returncode == 0, run.stderr
        return run.stderr.splitlines()
    err = stderr("copy: abc")
    assert err[0].startswith("note: 'copy: abc' is outside the prompts this model was trained on (copy: 4-12 ")
    assert len(err) == 2 and err[1].startswith("[")  # the statistics line
    assert len(stderr("copy: abcd")) == 1
    assert main(["list", "models"]) == 0
    assert "tiny-llada (llada): trained on copy: 4-12 of a-z0-9; " in capsys.readouterr().out


def test_a_bad_format_in_generation_config_is_one_line(tmp_path):
    model, tok = dllm.load("random:llada-tiny")
    dllm.save_pretrained(model, tok, tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"prompt_formats": ["copy: [a-z"]}))
    with pytest.raises(DllmError, match=r"prompt_formats must be a list of regular expressions, got \['copy: \[a-z'\]"):
        dllm.load(str(tmp_path))
