"""Recipes: the settings of a published table's cell, a small TOML file each in `data/recipes/`, with the number it
should reproduce and where that number is written (`dllm eval --recipe NAME`, `dllm list recipes`).

A recipe says the task, shots, chat template or not, answer length, block length, steps, sampler and cache with
their parameters, and LLaDA's generation options; `dllm eval --recipe NAME --model DIR` runs it, any other flag
given wins over it (`--task synthetic` gives a smoke run on a tiny model). Its `[published]` table holds the
metric, the value, the source (a URL, and where in it) and a note on what dllm's task does otherwise."""
from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dllm.core.errors import DllmError

RECIPES_DIR = Path(__file__).parent / "data" / "recipes"

SETTINGS = ("model", "arch", "task", "num_fewshot", "chat", "gen_length", "block_length", "steps", "sampler",
            "cache", "cfg_scale", "logits_eos_inf", "confidence_eos_eot_inf")
TABLES = ("sampler_args", "cache_args", "published")
PUBLISHED = ("metric", "value", "source", "where", "note")


@dataclass(frozen=True)
class Recipe:
    name: str
    model: str  # the checkpoint the number was measured on (its Hugging Face name)
    arch: str  # its family (`dllm.models.ARCHITECTURES_BY_NAME`)
    task: str
    num_fewshot: int
    chat: bool
    gen_length: int
    block_length: int
    steps: int
    sampler: str
    cache: str
    cfg_scale: float
    logits_eos_inf: bool
    confidence_eos_eot_inf: bool
    published: dict[str, Any]
    sampler_args: dict[str, Any] = field(default_factory=dict)
    cache_args: dict[str, Any] = field(default_factory=dict)

    def flags(self) -> dict[str, Any]:
        """The recipe as `dllm eval`'s parsed flags (what the command line gives wins over them); no model: the
        checkpoint is a local directory the caller names."""
        return {"task": self.task, "num_fewshot": self.num_fewshot, "chat": self.chat, "gen_length": self.gen_length,
                "block_length": self.block_length, "steps": self.steps, "sampler": self.sampler, "cache": self.cache,
                "sampler_arg": [f"{k}={v}" for k, v in self.sampler_args.items()],
                "cache_arg": [f"{k}={v}" for k, v in self.cache_args.items()], "cfg_scale": self.cfg_scale,
                "logits_eos_inf": self.logits_eos_inf, "confidence_eos_eot_inf": self.confidence_eos_eot_inf,
                "model": None}

    def describe(self) -> dict[str, Any]:
        """Name, model, task and settings, the published number and its source (`dllm list recipes --json`)."""
        settings = {k: getattr(self, k) for k in SETTINGS if k not in ("model", "task")}
        return {"name": self.name, "model": self.model, "task": self.task,
                "settings": {**settings, "sampler_args": self.sampler_args, "cache_args": self.cache_args},
                "published": self.published}


def read_recipe(path: Path) -> Recipe:
    """One recipe file, every key known and every setting present (else a one-line error naming the file)."""
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise DllmError(f"{path}: not valid TOML ({e})") from None
    unknown = sorted(set(data) - set(SETTINGS) - set(TABLES))
    missing = sorted(set(SETTINGS) - set(data))
    published = data.get("published", {})
    if unknown or missing:
        raise DllmError(f"{path}: {'unknown key ' + repr(unknown[0]) if unknown else 'missing ' + repr(missing[0])}; "
                        f"a recipe has {', '.join(SETTINGS + TABLES)}")
    if not isinstance(published, dict) or set(published) - set(PUBLISHED) or \
            not {"metric", "value", "source"} <= set(published):
        raise DllmError(f"{path}: [published] takes {', '.join(PUBLISHED)} (metric, value and source required)")
    return Recipe(path.stem, **{k: data[k] for k in SETTINGS}, published=published,
                  sampler_args=data.get("sampler_args", {}), cache_args=data.get("cache_args", {}))


def recipes() -> dict[str, Recipe]:
    """Every packaged recipe by name."""
    return {path.stem: read_recipe(path) for path in sorted(RECIPES_DIR.glob("*.toml"), key=lambda p: p.stem)}


def get_recipe(name: str) -> Recipe:
    known = recipes()
    if name not in known:
        raise DllmError(f"unknown recipe {name!r}; `dllm list recipes` shows them ({', '.join(known)})")
    return known[name]
