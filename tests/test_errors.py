"""Bad input gets a one-line DllmError that names the fix, from Python and from the CLI."""
import json
from dataclasses import dataclass

import pytest
import torch
from conftest import random_model

import dllm
from dllm import samplers
from dllm.cli import main
from dllm.core.errors import DllmError


@pytest.fixture(scope="module")
def tiny():
    return dllm.load("random:llada-tiny")


def one_line_error(fn, match):
    with pytest.raises(DllmError, match=match) as info:
        fn()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("kwargs,match", [
    (dict(sampler="nope"), "unknown sampler 'nope'; choose one of"),
    (dict(cache="xyz"), "unknown cache 'xyz'; choose one of"),
    (dict(sampler="low_confidence", threshold=0.9), "unknown parameter 'threshold'.*sampler takes temperature"),
    (dict(sampler="threshold", threshold=-0.5), "threshold=-0.5 is out of range; it must be >= 0.0"),
    (dict(temperature="hot"), "temperature must be float"),
    (dict(cache="dual", refresh_every=-1), "refresh_every=-1 is out of range"),
    (dict(gen_length=30, block_length=8), "gen_length \\(30\\) must be a multiple of block_length \\(8\\)"),
    (dict(gen_length=32, block_length=8, steps=6), "steps \\(6\\) must be a multiple of the number of blocks"),
    (dict(gen_length=0), "must be positive"),
    (dict(gen_length=1024, block_length=32), "exceeds the model's context of 512; shorten the prompt"),
])
def test_generate_rejects_bad_arguments(tiny, kwargs, match):
    model, tok = tiny
    one_line_error(lambda: dllm.generate(model, tok, ["hi"], **kwargs), match)


def test_empty_prompt(tiny):
    one_line_error(lambda: dllm.generate(tiny[0], tiny[1], [""], chat=False), "prompt 0 is empty; give some text")


def test_unknown_models(tmp_path):
    one_line_error(lambda: dllm.load("no-such-model"), "unknown model 'no-such-model'")
    one_line_error(lambda: dllm.load("random:gpt-9"),
                   "unknown random model 'random:gpt-9'; choose one of random:llada-8b")
    one_line_error(lambda: dllm.load(str(tmp_path)), "has no config.json")


def _checkpoint(tmp_path):
    model, tok = dllm.load("random:llada-tiny")
    dllm.save_pretrained(model, tok, tmp_path)
    return tmp_path


def test_checkpoint_problems(tmp_path):
    path = _checkpoint(tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    one_line_error(lambda: dllm.load(str(path)), "unknown model_type 'gpt2'.*supported: llada, Dream")
    (path / "config.json").write_text("{not json")
    one_line_error(lambda: dllm.load(str(path)), "is not valid JSON")
    (path / "config.json").write_text(json.dumps({**config, "n_layers": 3}))
    one_line_error(lambda: dllm.load(str(path)), "does not match config.json: missing 9 tensors")
    (path / "config.json").write_text(json.dumps({**config, "d_model": 32}))
    one_line_error(lambda: dllm.load(str(path)), "has shape .* config.json implies")
    (path / "config.json").write_text(json.dumps(config))
    weights = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    one_line_error(lambda: dllm.load(str(path)), "model.safetensors is corrupt")
    (path / "model.safetensors").unlink()
    one_line_error(lambda: dllm.load(str(path)), "no model.safetensors or model.safetensors.index.json")
    (path / "pytorch_model.bin").write_bytes(b"pickle")
    one_line_error(lambda: dllm.load(str(path)), "only pickle weights")


@pytest.mark.parametrize("edit,match", [
    (dict(mask_token_id=500), "mask token id 500 must be a token id below vocab_size 128"),
    (dict(pad_token_id=-1), "pad token id -1 must be"),
    (dict(eos_token_id="126"), "eos_token_id must be a token id or a list of them"),
    (dict(n_heads=0), "n_heads must be an integer >= 1, got 0"),
    (dict(n_layers="2"), "n_layers must be an integer, got '2'"),
    (dict(d_model="abc"), "d_model must be an integer, got 'abc'"),  # the file's own key, not ours (hidden_size)
    (dict(mlp_hidden_size=None, mlp_ratio="4"), "mlp_ratio must be a number, got '4'"),
    (dict(n_heads=3), "3 attention heads do not split hidden size 64"),
    (dict(rms_norm_eps="small"), "rms_norm_eps must be a number, got 'small'"),
    (dict(rms_norm_eps=-1.0), "rms_norm_eps must be a positive number"),
    (dict(d_model=None), "missing field 'd_model'"),
    (dict(mlp_hidden_size=None, mlp_ratio=1.5), "intermediate_size must be an integer >= 0, got 96.0"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "only default RoPE"),
])
def test_config_values_are_checked_at_load(tmp_path, edit, match):
    """A config.json value that would build a broken network stops the load, naming the file and the value."""
    path = _checkpoint(tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **edit}))
    one_line_error(lambda: dllm.load(str(path)), "config.json: .*" + match)


def test_config_nulls_and_eos_lists_load(tmp_path):
    """null means unset (our default applies); eos_token_id may be a list: each id stops a row, the first fills."""
    path = _checkpoint(tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "pad_token_id": None, "rope_theta": None,
                                                  "eos_token_id": [124, 125]}))
    cfg = dllm.load(str(path))[0].config
    assert (cfg.pad_id, cfg.filler_id, cfg.rope_theta) == (124, 124, 10000.0)
    assert {124, 125} <= set(cfg.stop_ids)


@pytest.mark.parametrize("file,content,match", [
    ("config.json", "[]", "config.json holds a JSON list, not an object"),
    ("config.json", b"\xff\xfe{", "cannot read .*config.json \\(UnicodeDecodeError"),
    ("generation_config.json", "null", "generation_config.json holds a JSON NoneType, not an object; fix or delete"),
])
def test_malformed_json_files(tmp_path, file, content, match):
    path = _checkpoint(tmp_path)
    (path / file).write_bytes(content if isinstance(content, bytes) else content.encode())
    one_line_error(lambda: dllm.load(str(path)), match)


def test_paths_are_paths(tmp_path, monkeypatch):
    """Only a bare name is a shipped model: `./tiny-llada` is the user's directory; `~` expands; a file is named."""
    _checkpoint(tmp_path / "tiny-llada")
    monkeypatch.chdir(tmp_path)
    assert dllm.load("./tiny-llada")[0].config.mask_id == 127  # the random preset's, not the shipped model's
    assert dllm.load("tiny-llada")[0].config.mask_id != 127
    monkeypatch.setenv("HOME", str(tmp_path))
    assert dllm.load("~/tiny-llada")[0].config.mask_id == 127
    one_line_error(lambda: dllm.load("tiny-llada/config.json"), "is a file; give the checkpoint directory")


def test_weights_that_are_not_floats_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file
    path = _checkpoint(tmp_path)
    state = load_file(str(path / "model.safetensors"))
    state["model.transformer.wte.weight"] = state["model.transformer.wte.weight"].to(torch.float8_e4m3fn)
    save_file(state, str(path / "model.safetensors"))
    one_line_error(lambda: dllm.load(str(path)), "wte.weight is torch.float8_e4m3fn; dllm loads float32, bfloat16")


def test_llada_qkv_bias_round_trips(tmp_path):
    """LLaDA's include_qkv_bias option: the biases load under their official names and are used."""
    import dataclasses

    from dllm.models import PRESETS
    from dllm.models.loading import build_model, init_random
    model = build_model(dataclasses.replace(PRESETS["llada-tiny"], qkv_bias=True), "cpu", torch.float32)
    init_random(model, seed=0)
    with torch.no_grad():
        model.layers[0].qkv_proj.bias.normal_()
    dllm.save_pretrained(model, None, tmp_path)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "model.transformer.blocks.0.k_proj.bias" in f.keys()
    loaded = build_model(model.config, "cpu", torch.float32)
    from dllm.models import llada
    from dllm.models.loading import load_weights
    load_weights(loaded, tmp_path, llada.WEIGHT_NAMES)
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def test_sharded_checkpoint_loads_and_missing_shard_is_named(tmp_path):
    from safetensors.torch import load_file, save_file
    path = _checkpoint(tmp_path)
    model, _ = dllm.load(str(path))
    state = load_file(str(path / "model.safetensors"))
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(path / f))
    (path / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded, _ = dllm.load(str(path))
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(sharded(ids), model(ids))
    (path / "model-00002-of-00002.safetensors").unlink()
    one_line_error(lambda: dllm.load(str(path)), "missing shard files model-00002-of-00002.safetensors")


def test_cli_prints_one_line_and_exits_2(capsys):
    assert main(["generate", "hi", "--model", "random:llada-tiny", "--sampler", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown sampler 'nope'") and err.count("\n") == 1
    assert main(["generate", "hi", "--model", "random:llada-tiny", "--sampler-arg", "threshold"]) == 2
    assert "--sampler-arg expects KEY=VALUE" in capsys.readouterr().err


def test_user_sampler_registers_and_runs(tiny):
    @samplers.register("leftmost_test")
    @dataclass
    class Leftmost(samplers.Sampler):
        """Commit the leftmost masked position."""

        def step(self, ctx):
            first = ctx.eligible.int().argmax(1)
            mask = torch.zeros_like(ctx.eligible)
            mask[torch.arange(mask.shape[0]), first] = True
            return samplers.Commit(mask & ctx.eligible, ctx.logits.argmax(-1), ctx.logits.amax(-1))

    out = dllm.generate(random_model("llada-tiny"), tiny[1], ["ab"], sampler="leftmost_test", gen_length=16,
                        block_length=8, stop_early=False, trace=True)
    assert [c[0]["position"] for step in out.trace for c in step["commits"]] == list(range(out.sequences.shape[1] - 16,
                                                                                           out.sequences.shape[1]))
    one_line_error(lambda: samplers.register("threshold")(Leftmost), "already registered")


def test_sampler_that_commits_nothing_is_an_error(tiny):
    @samplers.register("lazy_test")
    @dataclass
    class Lazy(samplers.Sampler):
        """Never commits."""

        def step(self, ctx):
            return samplers.Commit(torch.zeros_like(ctx.eligible), ctx.logits.argmax(-1), ctx.logits.amax(-1))

    one_line_error(lambda: dllm.generate(*tiny, ["ab"], sampler="lazy_test", gen_length=8, block_length=8),
                   "committed nothing for an unfinished row")


def test_sampler_mistakes_of_user_code_are_one_line(tiny):
    @samplers.register("none_test")
    @dataclass
    class ReturnsNothing(samplers.Sampler):
        def step(self, ctx):
            pass

    one_line_error(lambda: dllm.generate(*tiny, ["ab"], sampler="none_test", gen_length=8, block_length=8),
                   r"sampler 'none_test' returned NoneType from step; return a Commit\(mask, tokens, confidence\)")
    one_line_error(lambda: samplers.register("junk_test")(dict), "register a dataclass subclass of Sampler")

    @samplers.register("none_test")  # the same class defined again (a notebook cell run twice) replaces it
    @dataclass
    class ReturnsNothing(samplers.Sampler):  # noqa: F811
        def step(self, ctx):
            pass

    with pytest.raises(DllmError, match="'none_test' is already registered"):
        @samplers.register("none_test")
        @dataclass
        class Other(samplers.Sampler):
            pass


@pytest.mark.parametrize("kwargs,match", [
    (dict(sampler_args=[1]), "sampler_args must be a dict of parameters, got \\[1\\]"),
    (dict(sampler="adablock", delimiter_ids="9999"), "delimiter_ids has 9999, not a token id of this tokenizer"),
    (dict(sampler="adablock", delimiters="\u00e9"), "match no token of this tokenizer"),
])
def test_policy_values_that_cannot_work_are_refused(tiny, kwargs, match):
    one_line_error(lambda: dllm.generate(*tiny, ["ab"], chat=False, gen_length=8, block_length=8, **kwargs), match)


def test_numpy_integers_are_integers_and_load_checks_its_seed(tiny):
    import numpy as np
    out = dllm.generate(*tiny, ["ab"], chat=False, gen_length=np.int64(8), block_length=np.int32(8))
    assert out.sequences.shape[1] == 2 + 8
    one_line_error(lambda: dllm.load("random:llada-tiny", seed="x"), "seed \\(of the random weights\\) must be")


def test_sampler_whose_commits_differ_from_its_verified_draft_is_an_error(tiny):
    from dllm.samplers.speculative import Speculative

    @samplers.register("unfaithful_test")
    @dataclass
    class Unfaithful(Speculative):
        """Verifies drafts, then commits one position more than the draft it names."""

        def step(self, ctx):
            out = super().step(ctx)
            if out.verified is None:
                return out
            extra = ctx.eligible & ~out.mask
            extra &= extra.long().cumsum(1) == 1  # the first position the draft left masked
            return samplers.Commit(out.mask | extra, out.tokens, out.confidence, verified=out.verified)

    one_line_error(lambda: dllm.generate(*tiny, ["ab"], sampler="unfaithful_test", cache="dual", gen_length=16,
                                         block_length=16, stop_early=False),
                   "a sampler returned a verified draft that differs from its commits")


def test_corrupt_dream_tokenizer_is_one_line(tmp_path):
    """Dream's tokenizer falls back to Qwen2Tokenizer (its own class is remote code); that fallback fails in one
    line."""
    import shutil

    from dllm.models.loading import SHIPPED_DIR
    path = tmp_path / "dream"
    shutil.copytree(SHIPPED_DIR / "tiny-dream", path)
    (path / "tokenizer.json").write_text("{broken")
    one_line_error(lambda: dllm.load(str(path)), "cannot load the tokenizer in .*check its tokenizer files")
