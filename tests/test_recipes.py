"""Recipes (`dllm eval --recipe NAME`): every packaged recipe names a task that exists, lengths that fit
together, and settings its model family's sampler and cache accept; `dllm list recipes` and README show them."""
import json
import re

import pytest
from conftest import ROOT

import dllm
from dllm.cli import main
from dllm.engine.checks import check_lengths, check_policies
from dllm.engine.options import settle
from dllm.eval.recipes import PUBLISHED, read_recipe, recipes
from dllm.eval.tasks import get_task
from dllm.models import ARCHITECTURES_BY_NAME, PRESETS

RECIPES = recipes()


def test_the_tables_are_there():
    """LLaDA's EVAL.md (8B-Instruct, 1.5), Fast-dLLM's Tables 1 and 2, Dream, SDAR, LLaDA2."""
    prefixes = {name.split("-")[0] for name in RECIPES}
    assert prefixes == {"llada", "llada15", "fastdllm", "dream", "sdar", "llada2"}
    assert {"llada-instruct-gsm8k", "llada-instruct-math", "llada-instruct-humaneval", "llada-instruct-mbpp"} \
        <= set(RECIPES)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_can_run(name):
    r = RECIPES[name]
    task = get_task(r.task)
    task.load(None, r.num_fewshot)  # its shots exist
    check_lengths(r.gen_length, r.block_length, r.steps)
    assert r.arch in ARCHITECTURES_BY_NAME
    model = dllm.load(f"random:{r.arch}-tiny")[0]
    settings = settle(model, r.sampler, r.cache, sampler_args=r.sampler_args, cache_args=r.cache_args,
                      cfg_scale=r.cfg_scale, logits_eos_inf=r.logits_eos_inf,
                      confidence_eos_eot_inf=r.confidence_eos_eot_inf)
    check_policies(model, settings.sampler, settings.cache)
    released = next(cfg for preset, cfg in PRESETS.items() if cfg.arch == r.arch and not preset.endswith("-tiny"))
    assert not released.block_size or r.block_length == released.block_size  # a block-causal model's own block
    published = r.published
    assert set(published) <= set(PUBLISHED) and published["source"].startswith("https://")
    assert isinstance(published["value"], float) and 0 < published["value"] < 100


def test_a_recipe_with_an_unknown_key_is_refused(tmp_path):
    text = (ROOT / "eval" / "data" / "recipes" / "llada-instruct-gsm8k.toml").read_text()
    (tmp_path / "bad.toml").write_text(text.replace("steps = 512", "step = 512"))
    with pytest.raises(dllm.DllmError, match=r"bad.toml: unknown key 'step'; a recipe has model, arch"):
        read_recipe(tmp_path / "bad.toml")


def test_list_recipes(capsys):
    assert main(["list", "recipes", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [e["name"] for e in listed] == sorted(RECIPES)
    gsm8k = next(e for e in listed if e["name"] == "llada-instruct-gsm8k")
    assert gsm8k["model"] == "GSAI-ML/LLaDA-8B-Instruct" and gsm8k["published"]["value"] == 68.8
    assert gsm8k["settings"]["confidence_eos_eot_inf"] is True and gsm8k["settings"]["gen_length"] == 512
    assert main(["list", "recipes"]) == 0
    text = capsys.readouterr().out
    assert "llada-instruct-humaneval: GSAI-ML/LLaDA-8B-Instruct on humaneval (0-shot, chat), gen 512, block 512, " \
           "steps 512, low_confidence, cache none, logits_eos_inf: pass@1 47.0" in text


def test_readme_has_every_recipe_and_its_number():
    readme = (ROOT / "README.md").read_text()
    for name, r in RECIPES.items():
        row = next((line for line in readme.splitlines() if line.startswith(f"| `{name}` |")), None)
        assert row is not None, name
        assert f"| {r.published['value']} |" in row, row


def test_a_recipe_runs_on_a_tiny_model_with_the_flags_given_winning(tmp_path, capsys):
    """The smoke run: the recipe's sampler, cache, blocks and options on the synthetic task (a tiny model cannot
    read GSM8K); the flags given win, the published number is printed beside the result."""
    assert main(["eval", "--recipe", "fastdllm-llada-gsm8k-parallel", "--model", "tiny-llada", "--task", "synthetic",
                 "--num-fewshot", "0", "--gen-length", "64", "--limit", "4", "--output", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "recipe fastdllm-llada-gsm8k-parallel: published accuracy 78.5" in out
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["recipe"] == "fastdllm-llada-gsm8k-parallel"
    assert config["sampler"] == {"name": "threshold", "temperature": 0.0, "threshold": 0.9, "causal_first": False}
    assert config["cache"]["name"] == "prefix" and (config["gen_length"], config["block_length"]) == (64, 32)
    assert main(["eval", "--recipe", "llada-instruct-gsm8k", "--task", "synthetic"]) == 2
    assert re.search(r"recipe 'llada-instruct-gsm8k' evaluates GSAI-ML/LLaDA-8B-Instruct; give its local "
                     r"directory with --model", capsys.readouterr().err)
    assert main(["eval", "--recipe", "nope", "--model", "tiny-llada"]) == 2
    assert "unknown recipe 'nope'" in capsys.readouterr().err
