"""What a call decodes with: keyword parameters routed to the sampler or the cache, the default sampler and cache,
and the lengths (the caller's, else the model's `generation_config.json`, else its family's, else ours)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import cache as caches
from .. import samplers as samplers_mod
from ..core.errors import DllmError
from ..models import ARCHITECTURES_BY_NAME, DiffusionLM
from .checks import check_lengths

if TYPE_CHECKING:
    from ..cache import Cache
    from ..samplers import Sampler


def split_params(sampler: str | Sampler, cache: str | Cache, params: dict[str, Any],
                 sampler_args: dict[str, Any] | None = None, cache_args: dict[str, Any] | None = None,
                 model: DiffusionLM | None = None):
    """Build the sampler and the cache. `params` are routed by name and override `sampler_args`/`cache_args`,
    which override the `model`'s family defaults (`family_sampler_args`); a name that both take must go through
    those instead (never a silent choice); unknown names are an error."""
    for name, args in (("sampler_args", sampler_args), ("cache_args", cache_args)):
        if args is not None and not isinstance(args, dict):
            raise DllmError(f"{name} must be a dict of parameters, got {args!r}")
    sampler_cls = type(sampler) if isinstance(sampler, samplers_mod.Sampler) else samplers_mod.SAMPLERS.get(sampler)
    cache_cls = type(cache) if isinstance(cache, caches.Cache) else caches.CACHES.get(cache)
    both = sorted(set(params) & set(sampler_cls.param_names()) & set(cache_cls.param_names()))
    if both:
        raise DllmError(f"parameter {both[0]!r} is taken by both sampler {sampler_cls.name!r} and cache "
                        f"{cache_cls.name!r}; say which with sampler_args={{...}} or cache_args={{...}} "
                        f"(CLI: --sampler-arg or --cache-arg)")
    s_args = {**family_sampler_args(model, sampler), **(sampler_args or {}),
              **{k: v for k, v in params.items() if k in sampler_cls.param_names()}}
    c_args = {**(cache_args or {}), **{k: v for k, v in params.items() if k in cache_cls.param_names()}}
    unknown = sorted(set(params) - set(sampler_cls.param_names()) - set(cache_cls.param_names()))
    if unknown:
        raise DllmError(f"unknown parameter {unknown[0]!r} for sampler {sampler_cls.name!r} and cache "
                        f"{cache_cls.name!r}; sampler takes {', '.join(sampler_cls.param_names())}, cache takes "
                        f"{', '.join(cache_cls.param_names()) or 'nothing'}")
    return samplers_mod.SAMPLERS.create(sampler, **s_args), caches.CACHES.create(cache, **c_args)


DEFAULT_SAMPLER = "low_confidence"


def family_decoding(model: DiffusionLM) -> dict[str, Any]:
    """How the model's family decodes where ours would not fit it (DiffusionGemma: `diffusion_gemma.decoding`,
    over the keys of its generation_config.json): `sampler`, `sampler_args`, `block_length`, `steps_per_block`,
    `gen_length`; else {}."""
    decoding = getattr(ARCHITECTURES_BY_NAME[model.config.arch], "decoding", None)
    return {} if decoding is None else decoding(model.config, getattr(model, "generation_defaults", {}))


def model_sampler(model: DiffusionLM, sampler: str | Sampler | None, sampler_args: dict[str, Any] | None
                  ) -> tuple[str | Sampler, dict[str, Any] | None]:
    """The sampler to decode with, the caller's or else the family's (DiffusionGemma: entropy_bound) or ours, and
    its arguments: for the family's sampler named by name, those the model's generation_config.json sets under the
    caller's."""
    family = family_decoding(model)
    sampler = family.get("sampler", DEFAULT_SAMPLER) if sampler is None else sampler
    from_file = family.get("sampler_args")
    if from_file and sampler == family["sampler"] and (sampler_args is None or isinstance(sampler_args, dict)):
        try:
            samplers_mod.SAMPLERS.create(sampler, **from_file)
        except DllmError as e:
            raise DllmError(f"{e} (from the model's generation_config.json)") from None
        sampler_args = {**from_file, **(sampler_args or {})}
    return sampler, sampler_args


def family_sampler_args(model: DiffusionLM | None, sampler: str | Sampler) -> dict[str, Any]:
    """The parameters the model's family decodes with that the sampler `sampler` (a name; a ready object is taken
    as it is) takes: its module's `SAMPLER_DEFAULTS` (Nemotron-Labs-Diffusion: causal_first, as NVIDIA's
    `generate_diffusion`). The caller's parameters win."""
    if model is None or isinstance(sampler, samplers_mod.Sampler):
        return {}
    takes = samplers_mod.SAMPLERS.get(sampler).param_names()
    family = getattr(ARCHITECTURES_BY_NAME[model.config.arch], "SAMPLER_DEFAULTS", {})
    return {name: value for name, value in family.items() if name in takes}


def default_cache(model: DiffusionLM) -> str:
    """The cache used when none is named: on a block-causal or causal-prefix model the exact finished-block cache
    (the tokens of recomputing everything, far fewer rows computed), else none (the papers' vanilla decoding)."""
    return "block" if model.config.decoded_keys_fixed else "none"


DEFAULT_GEN_LENGTH = 64  # answer tokens: the canvas the shipped tiny models were trained on (48..64)

DEFAULT_BLOCK_LENGTH = 32


def decoding_lengths(model: DiffusionLM, gen_length: int | None = None, block_length: int | None = None,
                     steps: int | None = None) -> dict[str, int | None]:
    """gen_length, block_length and steps to decode with: the caller's, else the model directory's
    (`generation_config.json`), else its family's (`family_decoding`), else ours (block_length: a block-causal
    model's attention block). Validated, so a bad value fails before any work."""
    own, from_file, family = getattr(model, "generation_defaults", {}), [], family_decoding(model)

    def from_own(name: str, given):
        if given is None and name in own:
            from_file.append(name)
            return own[name]
        return given

    gen_length = from_own("gen_length", gen_length)
    gen_length = family.get("gen_length", DEFAULT_GEN_LENGTH) if gen_length is None else gen_length
    block_length = from_own("block_length", block_length)
    if block_length is None:  # a block-causal model decodes in its attention blocks; others in blocks of 32, or
        # of the largest size below that divides the answer (gen_length 48 alone: blocks of 24)
        block_length = family.get("block_length") or model.config.block_size or _default_block(gen_length)
    if "gen_length" in from_file:  # the file's steps belong to the file's length
        steps = from_own("steps", steps)
    try:
        check_lengths(gen_length, block_length, steps, model_block=block_length == model.config.block_size,
                      uniform=model.config.mask_id is None)
    except DllmError as e:
        if not from_file:
            raise
        raise DllmError(f"{e} ({' and '.join(from_file)} from the model's generation_config.json)") from None
    if steps is None and "steps_per_block" in family:
        steps = family["steps_per_block"] * (gen_length // block_length)
    return {"gen_length": gen_length, "block_length": block_length, "steps": steps}


def _default_block(gen_length) -> int:
    if isinstance(gen_length, bool) or not isinstance(gen_length, int) or gen_length < 1:
        return DEFAULT_BLOCK_LENGTH  # check_lengths names the problem
    return max(b for b in range(1, min(gen_length, DEFAULT_BLOCK_LENGTH) + 1) if gen_length % b == 0)


def lengths_for_answer(lengths: dict[str, int | None], max_tokens: int | None) -> dict[str, int | None]:
    """Decoding lengths (`decoding_lengths`) for an answer of at most `max_tokens` tokens: the canvas in whole
    blocks, the same steps per token; the caller cuts the answer at `max_tokens`."""
    lengths = dict(lengths)
    if max_tokens:
        block, gen, steps = lengths["block_length"], lengths["gen_length"], lengths["steps"]
        lengths["gen_length"] = new = -(-int(max_tokens) // block) * block
        if steps is not None:
            blocks = new // block
            lengths["steps"] = max(1, round(steps * new / gen / blocks)) * blocks
    return lengths
