"""scripts/train_tiny.py: seeded and resumable, and its bad flags fail with a message that names the fix."""
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import train_tiny  # noqa: E402

from dllm.eval.synthetic import training_format  # noqa: E402

TINY = ["--d", "16", "--layers", "1", "--heads", "2", "--batch-size", "4", "--train-per-family", "20",
        "--eval-per-family", "1", "--save-every", "1"]


def train(tmp_path, name, steps, *extra):
    train_tiny.main(["--arch", "dream", "--out", str(tmp_path / name), "--state", str(tmp_path / f"state-{name}"),
                     "--steps", str(steps), *TINY, *extra])
    return load_file(str(tmp_path / name / "model.safetensors"))


def test_an_interrupted_run_resumes_to_the_same_weights(tmp_path, monkeypatch):
    straight = train(tmp_path, "straight", 3)
    save = train_tiny.save_state

    def save_then_crash(state_dir, model, optimizer, step):
        save(state_dir, model, optimizer, step)
        if step == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(train_tiny, "save_state", save_then_crash)
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path, "resumed", 3)
    monkeypatch.setattr(train_tiny, "save_state", save)
    resumed = train(tmp_path, "resumed", 3)  # the same command again picks up at step 2
    written = json.loads((tmp_path / "straight" / "generation_config.json").read_text())
    assert written == {"multi_turn": False, **training_format()}  # the default mix draws every family
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)
    other_seed = train(tmp_path, "other", 3, "--seed", "1")
    assert any(not torch.equal(other_seed[k], straight[k]) for k in straight)


def test_bad_flags_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="write family:weight"):
        train(tmp_path, "m", 1, "--mix", "copy:1,mul:2")
    with pytest.raises(ValueError, match="write family:weight"):
        train(tmp_path, "m", 1, "--mix", "copy:x")
    with pytest.raises(ValueError, match="give at least one a positive weight"):
        train(tmp_path, "m", 1, "--mix", "copy:0")
    with pytest.raises(ValueError, match="--min-answer-length must be in"):
        train(tmp_path, "m", 1, "--min-answer-length", "10")
    with pytest.raises(ValueError, match="--eval-every must be at least 1, got 0"):
        train(tmp_path, "m", 1, "--eval-every", "0")


def test_a_state_of_another_model_is_refused(tmp_path):
    train(tmp_path, "small", 1)  # leaves its state in tmp_path/state-small
    with pytest.raises(ValueError, match="holds a run of a different model .*pass another --state"):
        train_tiny.main(["--arch", "dream", "--out", str(tmp_path / "wide"), "--state", str(tmp_path / "state-small"),
                         "--steps", "1", *TINY, "--d", "32"])


def test_init_starts_from_a_trained_checkpoint_of_the_same_model(tmp_path):
    """`--init DIR`: the run starts from DIR's weights (at learning rate 0 it saves them unchanged); a checkpoint of
    another size is refused in one line."""
    small = train(tmp_path, "small", 1)
    again = train(tmp_path, "again", 1, "--init", str(tmp_path / "small"), "--lr", "0")
    assert small.keys() == again.keys() and all(torch.equal(again[k], small[k]) for k in small)
    with pytest.raises(ValueError, match=r"--init .*small is another model \(config differs in .*drop --init"):
        train(tmp_path, "wide", 1, "--init", str(tmp_path / "small"), "--d", "32")


def test_the_seed_leaves_the_training_split_alone(tmp_path, monkeypatch):
    """`--seed` changes initialisation and batch order only: every seed trains on split 0, whose test prompts
    `dllm eval` holds out (a seed-1 split would only hold out seed-1 test prompts)."""
    seen, encode = [], train_tiny.encode

    def record(tok, arch, examples, *rest):
        seen.append(examples)
        return encode(tok, arch, examples, *rest)

    monkeypatch.setattr(train_tiny, "encode", record)
    train(tmp_path, "seed0", 1)
    train(tmp_path, "seed1", 1, "--seed", "1")
    assert seen[0] == seen[1]
