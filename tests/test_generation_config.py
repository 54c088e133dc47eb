"""A checkpoint decodes as its authors decode it with no flag (issue #34): every key of the released
`generation_config.json` files (tests/data/generation_config, SOURCES.md there) is applied or set aside with its
reason, the caller's flags win, and `dllm generate --explain` says where each value came from."""
import json
import shutil
from pathlib import Path

import pytest

import dllm
from dllm.cli import main
from dllm.engine.options import model_sampler, settle

FILES = Path(__file__).parent / "data" / "generation_config"
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]  # token ids: the tiny presets' tokenizers know few characters


def checkpoint(tmp_path, preset: str, file: str | None) -> str:
    """`random:<preset>` saved as a checkpoint directory, with a released generation_config.json (or none)."""
    model, tok = dllm.load(f"random:{preset}")
    dllm.save_pretrained(model, tok, tmp_path)
    if file is not None:
        shutil.copy(FILES / file, tmp_path / "generation_config.json")
    return str(tmp_path)


def decode(path: str, **flags) -> list[list[int]]:
    model, tok = dllm.load(path)
    out = dllm.generate(model, tok, PROMPTS, gen_length=16, stop_early=False, **flags)
    return out.sequences[:, -16:].tolist()


# family, preset, released file (None: not found), the authors' explicit settings (their `generate` call)
FAMILIES = [
    ("LLaDA-8B-Instruct", "llada-tiny", "llada-8b-instruct.json",  # generate.py: main() and its defaults
     dict(sampler="low_confidence", temperature=0.0, cfg_scale=0.0, block_length=16, steps=16)),
    ("LLaDA-8B-Instruct", "llada-tiny", "llada-8b-instruct-v4.46.json",
     dict(sampler="low_confidence", temperature=0.0, cfg_scale=0.0, block_length=16, steps=16)),
    ("LLaDA-8B-Instruct", "llada-tiny", "llada-8b-instruct-v4.51.json",
     dict(sampler="low_confidence", temperature=0.0, cfg_scale=0.0, block_length=16, steps=16)),
    ("LLaDA-1.5 (no file found)", "llada-tiny", None,
     dict(sampler="low_confidence", temperature=0.0, cfg_scale=0.0, block_length=16, steps=16)),
    ("Dream-v0-Instruct-7B", "dream-tiny", "dream-v0-instruct-7b.json",  # diffusion_generate(alg="origin", ...)
     dict(sampler="origin", temperature=0.0, eps=0.001, block_length=16, steps=16)),
    ("SDAR-4B-Chat", "sdar-tiny", "sdar-4b-chat.json",  # eval_sdar_hf.py: greedy, steps = block length
     dict(sampler="low_confidence", temperature=0.0, block_length=4, steps=16)),
    ("LLaDA2.0 (no file found)", "llada2-tiny", None,  # dFactory generate(): threshold 0.95, a step per position
     dict(sampler="low_confidence_dynamic", threshold=0.95, temperature=0.0, block_length=4, steps=16)),
    ("LLaDA-MoE (no file found)", "llada-moe-tiny", None,  # LLaDA's generate.py
     dict(sampler="low_confidence", temperature=0.0, block_length=16, steps=16)),
    ("Fast-dLLM v2 (no file found)", "fast-dllm-v2-tiny", None,  # its generate(): sub-blocks of 8, threshold 0.9
     dict(sampler="sub_block", sub_block=8, threshold=0.9, temperature=0.0, block_length=4)),
]


@pytest.mark.parametrize("family,preset,file,authors", FAMILIES, ids=[f"{f[0]}:{f[2]}" for f in FAMILIES])
def test_no_flags_decode_as_the_authors_explicit_settings(tmp_path, family, preset, file, authors):
    path = checkpoint(tmp_path, preset, file)
    assert decode(path) == decode(path, **authors)
    if file is not None:  # every key of the file is accounted for
        keys = set(json.loads((FILES / file).read_text()))
        assert set(dllm.load(path)[0].generation_defaults.notes) == keys


def test_dreams_file_is_what_decides_and_without_it_dllms_defaults_do(tmp_path):
    """Dream's alg (origin, one block over the whole answer) against dllm's low_confidence (here in one block of
    16 too): the file changes the answer, and the caller's flags win over it."""
    path = checkpoint(tmp_path, "dream-tiny", "dream-v0-instruct-7b.json")
    bare = checkpoint(tmp_path / "bare", "dream-tiny", None)
    assert decode(path) != decode(bare)
    assert decode(path, sampler="low_confidence") == decode(bare)
    assert decode(path, sampler="entropy") == decode(path, sampler="entropy", block_length=16, eps=0.001)


def test_sdars_autoregressive_sampling_keys_are_set_aside(tmp_path):
    """SDAR's file carries Qwen3's do_sample / temperature 0.6 / top_k 20 / top_p 0.95, which SDAR's own decoding
    never reads: applied, they would sample."""
    path = checkpoint(tmp_path, "sdar-tiny", "sdar-4b-chat.json")
    notes = dllm.load(path)[0].generation_defaults.notes
    for key in ("do_sample", "temperature", "top_k", "top_p"):
        assert notes[key].startswith("not applied: the autoregressive base model's sampling setting; the authors' "
                                     "decoding (JetAstra/SDAR's evaluation")
    assert notes["eos_token_id"] == "stop ids: an answer ends at 151645, 151643"
    assert decode(path) != decode(path, temperature=0.6)


def test_explain_says_where_every_value_came_from(tmp_path, capsys):
    path = checkpoint(tmp_path, "dream-tiny", "dream-v0-instruct-7b.json")
    assert main(["generate", "hi", "--model", path, "--explain", "--json", "--gen-length", "32",
                 "--sampler-arg", "eps=0.01"]) == 0
    explained = json.loads(capsys.readouterr().out)
    settings, notes = explained["settings"], explained["generation_config.json"]
    assert settings["sampler"] == {"value": "origin", "from": "generation_config.json (alg)"}
    assert settings["sampler.temperature"] == {"value": 0.0, "from": "generation_config.json (temperature)"}
    assert settings["sampler.eps"] == {"value": 0.01, "from": "caller"}  # the flag wins over the file
    assert settings["gen_length"] == {"value": 32, "from": "caller"}
    assert settings["block_length"]["value"] == 32 and settings["block_length"]["from"].startswith("the whole answer")
    assert settings["cfg_scale"]["value"] == 0.0
    assert notes["steps"].startswith("not applied: no max_new_tokens to go with it")
    assert notes["top_p"] == "null: unset (the sampler's default)"
    assert notes["output_history"].startswith("not applied: Dream's history of canvases")
    assert main(["generate", "hi", "--model", path, "--explain", "--sampler", "threshold"]) == 0
    text = capsys.readouterr().out
    assert "sampler = 'threshold'" in text and "(caller)" in text
    assert "eps: not used: sampler 'threshold' takes no eps" in text
    assert "sampler.temperature = 0.0" in text and "(generation_config.json (temperature))" in text


def test_one_path_caller_then_file_then_family_then_ours(tmp_path):
    """`model_sampler` is the one place a checkpoint's sampler settings come from (generate, the CLI, serve and
    eval take it; `settle`, behind --explain, reports it): the caller's, else generation_config.json's (to
    whichever sampler takes them), else the family's (to the family's sampler only), else ours."""
    dream, _ = dllm.load(checkpoint(tmp_path, "dream-tiny", "dream-v0-instruct-7b.json"))
    assert model_sampler(dream, None, None) == ("origin", {"temperature": 0.0, "eps": 0.001})
    assert model_sampler(dream, None, {"eps": 0.01}) == ("origin", {"temperature": 0.0, "eps": 0.01})
    assert model_sampler(dream, "threshold", None) == ("threshold", {"temperature": 0.0})  # eps: threshold has none
    llada2, _ = dllm.load("random:llada2-tiny")  # no file: the family's decoding
    assert model_sampler(llada2, None, None) == ("low_confidence_dynamic", {"threshold": 0.95})
    assert model_sampler(llada2, None, {"threshold": 0.8}) == ("low_confidence_dynamic", {"threshold": 0.8})
    assert model_sampler(llada2, "threshold", None) == ("threshold", {})  # the family's 0.95 is not threshold's
    nemotron, _ = dllm.load("random:nemotron-diffusion-tiny")  # the family's default for any sampler taking it
    assert model_sampler(nemotron, "threshold", None) == ("threshold", {"causal_first": True})
    assert model_sampler(nemotron, "threshold", {"causal_first": False}) == ("threshold", {"causal_first": False})
    assert model_sampler(nemotron, "entropy", None) == ("entropy", {})
    llada, _ = dllm.load("random:llada-tiny")
    assert model_sampler(llada, None, None) == ("low_confidence", {})
    for model in (dream, llada2, nemotron, llada):
        settings = settle(model)
        name, args = model_sampler(model, None, None)
        assert settings.sampler.name == name
        assert {k: v for k, v in settings.sampler.config().items() if k in args} == args


def test_save_pretrained_keeps_the_files_settings(tmp_path):
    """A saved checkpoint's generation_config.json carries what the loaded one said (the sampler, its
    parameters under the file's names, the family's keys as they were)."""
    model, tok = dllm.load(checkpoint(tmp_path / "a", "dream-tiny", "dream-v0-instruct-7b.json"))
    dllm.save_pretrained(model, tok, tmp_path / "b")
    saved = json.loads((tmp_path / "b" / "generation_config.json").read_text())
    assert saved == {"alg": "origin", "temperature": 0.0, "eps": 0.001}
    assert model_sampler(dllm.load(str(tmp_path / "b"))[0], None, None) == model_sampler(model, None, None)


def test_a_family_default_comes_from_its_authors(tmp_path, capsys):
    assert main(["generate", "hi", "--model", "random:llada2-tiny", "--explain"]) == 0
    text = capsys.readouterr().out
    assert "sampler = 'low_confidence_dynamic'" in text and "inclusionAI/dFactory LLaDA2.0 generate()" in text
    assert "sampler.threshold = 0.95" in text


def test_a_file_value_that_cannot_be_right_is_refused_before_any_work(tmp_path):
    path = checkpoint(tmp_path, "dream-tiny", None)
    (tmp_path / "generation_config.json").write_text(json.dumps({"alg": "origin", "top_p": 1.5}))
    model, tok = dllm.load(path)  # a sampler parameter is checked by the sampler, before any work
    with pytest.raises(dllm.DllmError, match="top_p=1.5 is out of range.*\\(from the model's generation_config"):
        dllm.generate(model, tok, PROMPTS)
    (tmp_path / "generation_config.json").write_text(json.dumps({"mask_token_id": 3}))
    with pytest.raises(dllm.DllmError, match="says mask_token_id 3, config.json 127; make them agree"):
        dllm.load(path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"alg": "confidence_threshold"}))
    notes = dllm.load(path)[0].generation_defaults.notes
    assert notes["alg"].startswith("'confidence_threshold' is not one of the authors' algorithms")
