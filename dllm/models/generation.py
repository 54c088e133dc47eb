"""What a checkpoint's `generation_config.json` says to decode with, read key by key: each key applied or set aside
with the reason (`GenerationConfig.notes`, shown by `dllm generate --explain`). A family module says which keys its
authors' `generate` reads (`SAMPLER_KEYS`: file key -> our sampler keyword; `GENERATION_KEYS`: kept as they are
for its `decoding`); the other sampling keys of a released file are its autoregressive base model's. What wins
over what is `dllm.engine.options.model_sampler`'s: the caller, this file, the family's `decoding`, ours."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from ..core.errors import DllmError

# key -> our keyword: lengths (transformers' name for the answer length, LLaDA's for the rest), read for every family
LENGTH_KEYS = {"max_new_tokens": "gen_length", "block_length": "block_length", "steps": "steps"}

AR_SAMPLING_KEYS = ("do_sample", "temperature", "top_p", "top_k", "repetition_penalty", "min_p", "typical_p")

# keys that change nothing here, and why
NOT_DECODING = {
    "_from_model_config": "transformers' bookkeeping",
    "transformers_version": "transformers' bookkeeping",
    "bos_token_id": "a prompt gets its BOS from the tokenizer and its chat template",
    "pad_token_id": "the canvas is padded with config.json's pad_token_id",
    "use_cache": "transformers' autoregressive KV cache switch; dllm's cache is --cache (default: none, or block "
                 "on a block-causal model: exact either way)",
    "output_history": "Dream's history of canvases; dllm records every step with --trace",
    "return_dict_in_generate": "transformers' output format",
    "num_return_sequences": "one answer per prompt; give a prompt several times with seed=[...] for more",
    "max_length": "transformers' prompt-plus-answer cap; the answer length is max_new_tokens",
}


@dataclass
class GenerationConfig:
    """A checkpoint directory's `generation_config.json` read key by key: `values` (our keyword -> value: the
    lengths, `sampler`; ours: `multi_turn`, `prompt_formats`, `trained_on`), `sampler_args` (the sampler
    parameters it sets, by our names), `keys` (our keyword -> the file's key it came from), `family` (the keys the
    family's `decoding` reads, as they are), `notes` (every key of the file -> what became of it), `stop_ids` (its
    eos_token_id: an answer ends at each), `one_block` (a file that names the algorithm means the authors'
    `generate`, which decodes the whole answer as one block: Dream's `diffusion_generate`)."""

    values: dict[str, Any] = field(default_factory=dict)
    sampler_args: dict[str, Any] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    family: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    stop_ids: tuple[int, ...] = ()
    one_block: bool = False

    def get(self, name: str, default=None):
        return self.values.get(name, default)


def _regexes(value) -> bool:
    try:
        return isinstance(value, list) and all(isinstance(v, str) and re.compile(v) for v in value)
    except re.error:
        return False


def read_generation_config(hf: dict, family: ModuleType, file: Path) -> GenerationConfig:
    """The decoding settings of `hf`, the contents of `file` (a `generation_config.json`), for a model of the
    `family` module. A value that cannot be right is a one-line error naming the file (a sampler parameter's:
    when the sampler is built, `model_sampler`)."""
    out = GenerationConfig()
    sampler_keys, kept = getattr(family, "SAMPLER_KEYS", {}), getattr(family, "GENERATION_KEYS", ())
    algorithms = getattr(family, "ALGORITHMS", ())

    def bad(key: str, want: str):
        return DllmError(f"{file}: {key} must be {want}, got {hf[key]!r}; fix or delete it")

    def take(key: str, ours: str, value, note: str) -> None:
        out.values[ours], out.keys[ours], out.notes[key] = value, key, note

    for key, value in hf.items():
        if key in LENGTH_KEYS:
            if value is None:
                out.notes[key] = "null: unset"
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(key, "a positive integer")
            take(key, LENGTH_KEYS[key], value, f"{LENGTH_KEYS[key]} = {value}")
        elif key == "multi_turn":
            if not isinstance(value, bool):
                raise DllmError(f"{file}: multi_turn must be true or false, got {value!r}; fix or delete it")
            take(key, "multi_turn", value, f"dllm chat {'keeps' if value else 'does not keep'} the conversation")
        elif key == "trained_on":  # ours, with prompt_formats: the prompts a shipped model was trained on
            if not isinstance(value, str):
                raise bad(key, "a string")
            take(key, key, value, "said when a prompt is outside the prompt formats")
        elif key == "prompt_formats":
            if not _regexes(value):
                raise bad(key, "a list of regular expressions")
            take(key, key, value, "a prompt outside these regular expressions gets a notice")
        elif key == "eos_token_id":
            ids = value if isinstance(value, list) else [value]
            if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
                raise bad(key, "a token id or a list of them")
            out.stop_ids = tuple(ids)
            out.notes[key] = f"stop ids: an answer ends at {', '.join(map(str, ids))}"
        elif key == "mask_token_id":
            out.notes[key] = "null: config.json's mask_token_id" if value is None else \
                "checked against config.json's mask_token_id"
        elif sampler_keys.get(key) == "sampler":
            if value not in algorithms:
                out.notes[key] = f"{value!r} is not one of the authors' algorithms ({', '.join(algorithms)}); not " \
                                 f"applied"
                continue
            take(key, "sampler", value, f"sampler {value}; the answer decoded as one block, as the authors' generate")
            out.one_block = True
        elif key in sampler_keys:
            ours = sampler_keys[key]
            if value is None:
                out.notes[key] = "null: unset (the sampler's default)"
                continue
            out.sampler_args[ours], out.keys[f"sampler.{ours}"] = value, key
            out.notes[key] = f"{ours} = {value} (where the sampler takes it)"
        elif key in kept:
            if value is not None:
                out.family[key] = value
            out.notes[key] = f"read by {family.__name__.rsplit('.', 1)[-1]}.decoding ({family.AUTHORS_DECODING})"
        elif key in AR_SAMPLING_KEYS:
            out.notes[key] = (f"not applied: the autoregressive base model's sampling setting; the authors' "
                              f"decoding ({family.AUTHORS_DECODING}) never reads it")
        elif key in NOT_DECODING:
            out.notes[key] = f"not applied: {NOT_DECODING[key]}"
        else:
            out.notes[key] = "not a decoding setting dllm knows; not applied"
    if "steps" in out.values and "gen_length" not in out.values:  # steps belong to the length they were chosen for
        del out.values["steps"], out.keys["steps"]
        out.notes["steps"] = ("not applied: no max_new_tokens to go with it; steps default to gen_length, one "
                              "token per step")
    return out
