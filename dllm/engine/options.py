"""What a call decodes with and where each value came from (`settle`): the caller's keywords, else the model
directory's `generation_config.json` (`dllm.models.generation`), else its family's (the family module's `decoding`),
else ours (`model_sampler`, `decoding_lengths`); keyword parameters routed to the sampler or the cache; the default
cache."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from .. import cache as caches
from .. import samplers as samplers_mod
from ..core.errors import DllmError
from ..models import ARCHITECTURES_BY_NAME, DiffusionLM
from .checks import check_auto_length, check_guidance, check_lengths
from .guidance import Guidance

if TYPE_CHECKING:
    from ..cache import Cache, PrefixBlocks
    from ..samplers import Sampler


def split_params(sampler: str | Sampler, cache: str | Cache, params: dict[str, Any],
                 sampler_args: dict[str, Any] | None = None, cache_args: dict[str, Any] | None = None):
    """Build the sampler and the cache. `params` are routed by name and override `sampler_args`/`cache_args`
    (the model's settings under the caller's: `model_sampler`); a name that both take must go through those
    instead (never a silent choice); unknown names are an error."""
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
    s_args = {**(sampler_args or {}), **{k: v for k, v in params.items() if k in sampler_cls.param_names()}}
    c_args = {**(cache_args or {}), **{k: v for k, v in params.items() if k in cache_cls.param_names()}}
    unknown = sorted(set(params) - set(sampler_cls.param_names()) - set(cache_cls.param_names()))
    if unknown:
        raise DllmError(f"unknown parameter {unknown[0]!r} for sampler {sampler_cls.name!r} and cache "
                        f"{cache_cls.name!r}; sampler takes {', '.join(sampler_cls.param_names())}, cache takes "
                        f"{', '.join(cache_cls.param_names()) or 'nothing'}")
    return samplers_mod.SAMPLERS.create(sampler, **s_args), caches.CACHES.create(cache, **c_args)


DEFAULT_SAMPLER = "low_confidence"


def family_decoding(model: DiffusionLM) -> dict[str, Any]:
    """How the model's family decodes where ours would not fit it (the family module's `decoding`, over the keys of
    its generation_config.json that it reads: DiffusionGemma, LLaDA2, Fast-dLLM v2, Nemotron): `sampler`,
    `sampler_args` (for that sampler), `any_sampler_args` (for whichever sampler takes them: Nemotron's
    causal_first), `block_length`, `steps_per_block`, `gen_length`; else {}."""
    decoding = getattr(ARCHITECTURES_BY_NAME[model.config.arch], "decoding", None)
    return {} if decoding is None else decoding(model.config, model.generation_defaults.family)


def _family_source(model: DiffusionLM) -> str:
    return f"{model.config.arch} authors' decoding: {ARCHITECTURES_BY_NAME[model.config.arch].AUTHORS_DECODING}"


def _file_source(model: DiffusionLM, name: str) -> str:
    return f"generation_config.json ({model.generation_defaults.keys.get(name, name)})"


def model_sampler(model: DiffusionLM, sampler: str | Sampler | None, sampler_args: dict[str, Any] | None
                  ) -> tuple[str | Sampler, dict[str, Any] | None]:
    """The sampler to decode with and its arguments: the caller's, else the model's generation_config.json's
    (Dream's `alg`), else its family's (`family_decoding`), else low_confidence. The file's sampler parameters go
    to whichever sampler takes them (as transformers' generation config), the family's to the family's sampler,
    and its `any_sampler_args` to any sampler that takes them (Nemotron's causal_first), each under
    the caller's; the file's are checked here, naming it."""
    return _model_sampler(model, sampler, sampler_args)[:2]


def _model_sampler(model: DiffusionLM, sampler, sampler_args):
    """`model_sampler`, and where each value came from (`sources`) and what became of the file's sampler keys
    (`notes`)."""
    own, family, sources, notes = model.generation_defaults, family_decoding(model), {}, {}
    if sampler is not None:
        sources["sampler"] = "caller"
    elif "sampler" in own.values:
        sampler, sources["sampler"] = own.values["sampler"], _file_source(model, "sampler")
    elif "sampler" in family:
        sampler, sources["sampler"] = family["sampler"], _family_source(model)
    else:
        sampler, sources["sampler"] = DEFAULT_SAMPLER, "dllm default"
    if isinstance(sampler, samplers_mod.Sampler) or not isinstance(sampler_args, (dict, type(None))):
        return sampler, sampler_args, sources, notes  # a built sampler keeps its own; split_params names bad args
    takes = samplers_mod.SAMPLERS.get(sampler).param_names()
    args = {**{name: value for name, value in family.get("any_sampler_args", {}).items() if name in takes},
            **(family.get("sampler_args", {}) if sampler == family.get("sampler") else {})}
    sources.update({f"sampler.{name}": _family_source(model) for name in args})
    for name, value in own.sampler_args.items():
        key = own.keys[f"sampler.{name}"]
        if name in takes:
            args[name], sources[f"sampler.{name}"] = value, f"generation_config.json ({key})"
        else:
            notes[key] = f"not used: sampler {sampler!r} takes no {name}"
    try:
        samplers_mod.SAMPLERS.create(sampler, **args)
    except DllmError as e:  # named as the file names them (DiffusionGemma's stability_threshold is our stability)
        given = ", ".join(f"{own.keys[f'sampler.{name}']} {value!r}" for name, value in own.sampler_args.items()
                          if name in takes)
        raise DllmError(f"{e} (from the model's generation_config.json: {given})") from None
    sources.update({f"sampler.{name}": "caller" for name in sampler_args or {}})
    return sampler, {**args, **(sampler_args or {})}, sources, notes


def default_cache(model: DiffusionLM) -> str:
    """The cache used when none is named: on a causal model (WeDLM) the exact frontier cache, on a block-causal or
    causal-prefix model the exact finished-block cache (each the tokens of recomputing everything, far fewer rows
    computed), else none (the papers' vanilla decoding)."""
    if model.config.causal:
        return "frontier"
    return "block" if model.config.decoded_keys_fixed else "none"


DEFAULT_GEN_LENGTH = 64  # answer tokens: the canvas the shipped tiny models were trained on (48..64)

DEFAULT_BLOCK_LENGTH = 32


def decoding_lengths(model: DiffusionLM, gen_length: int | None = None, block_length: int | None = None,
                     steps: int | None = None) -> dict[str, int | None]:
    """gen_length, block_length and steps to decode with: the caller's, else the model directory's
    (`generation_config.json`), else its family's (`family_decoding`), else ours (block_length: a block-causal
    model's attention block). Validated, so a bad value fails before any work."""
    return _lengths(model, gen_length, block_length, steps)[0]


def _lengths(model: DiffusionLM, gen_length, block_length, steps) -> tuple[dict[str, int | None], dict[str, str]]:
    """`decoding_lengths` and where each came from."""
    own, family = model.generation_defaults, family_decoding(model)
    sources = {name: "caller" for name, v in (("gen_length", gen_length), ("block_length", block_length),
                                               ("steps", steps)) if v is not None}
    if isinstance(gen_length, samplers_mod.Daedal):  # gen_length auto: blocks of the caller's or ours, no steps
        block_length = DEFAULT_BLOCK_LENGTH if block_length is None else block_length
        sources.setdefault("block_length", "dllm default")
        sources["steps"] = "gen_length auto: block_length per block (a schedule's steps)"
        check_lengths(gen_length, block_length, steps)
        return {"gen_length": gen_length, "block_length": block_length, "steps": None}, sources
    from_file = []

    def from_own(name: str, given):
        if given is None and name in own.values:
            from_file.append(name)
            sources[name] = _file_source(model, name)
            return own.values[name]
        return given

    gen_length = from_own("gen_length", gen_length)
    if gen_length is None:
        gen_length = family.get("gen_length", DEFAULT_GEN_LENGTH)
        sources["gen_length"] = _family_source(model) if "gen_length" in family else "dllm default"
    block_length = from_own("block_length", block_length)
    if block_length is None and own.one_block:
        block_length = gen_length
        sources["block_length"] = (f"the whole answer: generation_config.json ({own.keys['sampler']}) means the "
                                   f"authors' generate, which has no blocks")
    if block_length is None and family.get("block_length"):
        block_length, sources["block_length"] = family["block_length"], _family_source(model)
    if block_length is None:  # a block-causal model decodes in its attention blocks; others in blocks of 32, or
        # of the largest size below that divides the answer (gen_length 48 alone: blocks of 24)
        block_length = model.config.block_size or _default_block(gen_length)
        sources["block_length"] = "the model's attention block" if model.config.block_size else "dllm default"
    if "gen_length" in from_file:  # the file's steps belong to the file's length
        steps = from_own("steps", steps)
    try:
        check_lengths(gen_length, block_length, steps, model_block=block_length == model.config.block_size,
                      uniform=model.config.mask_id is None)
    except DllmError as e:
        if not from_file:
            raise
        given = ", ".join(f"{own.keys[name]} {own.values[name]!r}" for name in from_file)
        raise DllmError(f"{e} (from the model's generation_config.json: {given})") from None
    if steps is None and "steps_per_block" in family:
        steps, sources["steps"] = family["steps_per_block"] * (gen_length // block_length), _family_source(model)
    sources.setdefault("steps", "gen_length: one token per step")
    return {"gen_length": gen_length, "block_length": block_length, "steps": steps}, sources


def _default_block(gen_length) -> int:
    if isinstance(gen_length, bool) or not isinstance(gen_length, int) or gen_length < 1:
        return DEFAULT_BLOCK_LENGTH  # check_lengths names the problem
    return max(b for b in range(1, min(gen_length, DEFAULT_BLOCK_LENGTH) + 1) if gen_length % b == 0)


def auto_length(gen_length, length_args: dict[str, Any] | None) -> Any:
    """gen_length as given, or "auto" as DAEDAL's length policy (`samplers.Daedal`) with `length_args` (its
    parameters: max_gen_length, initial_gen_length, ...), which need it."""
    if isinstance(length_args, dict) and not length_args:
        length_args = None
    if length_args is not None and not isinstance(length_args, dict):
        raise DllmError(f"length_args must be a dict of gen_length auto's parameters, got {length_args!r}")
    if isinstance(gen_length, str) and gen_length != "auto":
        raise DllmError(f"gen_length must be a number of answer tokens or 'auto', got {gen_length!r}")
    if isinstance(gen_length, samplers_mod.Daedal) and length_args is not None:
        raise DllmError(f"{', '.join(length_args)} given with a ready length policy (samplers.Daedal); set them on it")
    if gen_length != "auto":
        if length_args is not None:
            raise DllmError(f"{', '.join(length_args)} set{'s' if len(length_args) == 1 else ''} how gen_length auto "
                            f"grows an answer; add gen_length='auto' (CLI: --gen-length auto) or drop it")
        return gen_length
    unknown = sorted(set(length_args or {}) - set(samplers_mod.Daedal.param_names()))
    if unknown:
        raise DllmError(f"unknown parameter {unknown[0]!r} for gen_length auto (DAEDAL); it takes "
                        f"{', '.join(samplers_mod.Daedal.param_names())}")
    return samplers_mod.Daedal(**(length_args or {}))


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


@dataclass
class Settings:
    """What one call decodes with (`settle`): the sampler, the cache, the lengths and LLaDA's generation options,
    and for each setting where its value came from (`sources`); `notes`: every key of the model's
    generation_config.json and what became of it."""

    sampler: Sampler
    cache: Cache
    lengths: dict[str, Any]  # gen_length: answer tokens, or a `samplers.Daedal` (gen_length auto)
    guidance: Guidance
    sources: dict[str, str]
    notes: dict[str, str]

    def explain(self) -> dict[str, Any]:
        """`{"settings": {name: {"value", "from"}}, "generation_config.json": notes}` (`dllm generate --explain`)."""
        gen = self.lengths["gen_length"]
        auto = isinstance(gen, samplers_mod.Daedal)
        values = {"sampler": self.sampler.name, **{f"sampler.{k}": v for k, v in self.sampler.config().items()
                                                   if k != "name"},
                  "cache": self.cache.name, **{f"cache.{k}": v for k, v in self.cache.config().items() if k != "name"},
                  **self.lengths, "gen_length": "auto" if auto else gen,
                  **({f"length.{k}": v for k, v in gen.config().items() if k != "name"} if auto else {}),
                  **self.guidance.config()}
        defaults = {"length": "DAEDAL's paper"}
        settings = {name: {"value": value, "from": self.sources.get(name, defaults.get(
            name.split(".")[0], f"the {name.split('.')[0]}'s default"))} for name, value in values.items()}
        return {"settings": settings, "generation_config.json": dict(self.notes)}


def settle(model: DiffusionLM, sampler: str | Sampler | None = None, cache: str | Cache | None = None,
           params: dict[str, Any] | None = None, sampler_args: dict[str, Any] | None = None,
           cache_args: dict[str, Any] | None = None, gen_length: int | str | Any = None,
           block_length: int | None = None, steps: int | None = None, cfg_scale: float = 0.0,
           logits_eos_inf: bool = False, confidence_eos_eot_inf: bool = False,
           length_args: dict[str, Any] | None = None) -> Settings:
    """The caller's settings over the model's, each with where it came from: the sampler and its parameters
    (`model_sampler`), the cache (the caller's, else `default_cache`), the lengths (`decoding_lengths`) and LLaDA's
    options (`engine.guidance`). Every value is checked before any work. gen_length "auto" (with `length_args`, or a
    `samplers.Daedal`): each answer chooses its length (DAEDAL), decoded with sampler threshold (DAEDAL's fill rule)
    unless one is named."""
    params = dict(params or {})
    for name, args in (("sampler_args", sampler_args), ("cache_args", cache_args)):
        if args is not None and not isinstance(args, dict):
            raise DllmError(f"{name} must be a dict of parameters, got {args!r}")
    gen_length = auto_length(gen_length, length_args)
    auto = isinstance(gen_length, samplers_mod.Daedal)
    fill_rule = auto and sampler is None
    sampler, sampler_args, sources, notes = _model_sampler(model, "threshold" if fill_rule else sampler, sampler_args)
    if fill_rule:
        sources["sampler"] = "gen_length auto: DAEDAL's fill rule (threshold 0.9)"
    sources.update({f"length.{name}": "caller" for name in length_args or {}})
    for kind, names in (("sampler", params), ("cache", [*(cache_args or {}), *params])):
        sources.update({f"{kind}.{name}": "caller" for name in names})
    sources["cache"] = "caller" if cache is not None else "dllm default for this model"
    sampler, cache = split_params(sampler, default_cache(model) if cache is None else cache, params, sampler_args,
                                  cache_args)
    if sampler.slides:  # no blocks, no schedule of steps: its window decides each step's fills
        window = (f"sampler {sampler.name!r} fills masks of its window of W = {sampler.window_size} after each "
                  f"row's committed prefix, at least one a step, until the answer is done")
        lengths, length_sources = _lengths(model, gen_length, None, None)
        given = "steps" if steps is not None else None
        if block_length not in (None, lengths["gen_length"]):  # (the whole answer: what settle says it is)
            given = "block_length"
        if given:
            raise DllmError(f"{given} does not apply to sampler {sampler.name!r}, which has no blocks and no schedule "
                            f"of steps: each step fills masks of its window of W = {sampler.window_size} slots; drop "
                            f"{given} (the window's size is the sampler parameter window_size)")
        lengths.update(block_length=lengths["gen_length"], steps=None)
        length_sources.update(block_length=f"the whole answer: {window}", steps=f"not used: {window}")
    else:
        lengths, length_sources = _lengths(model, gen_length, block_length, steps)
    guidance = Guidance(cfg_scale, logits_eos_inf, confidence_eos_eot_inf)
    for name, value in guidance.config().items():
        sources[name] = "caller" if value else "off by default, as in LLaDA's generate.py"
    check_guidance(model, sampler, cache, guidance)
    if auto:
        check_auto_length(model, sampler, cache, False, guidance)
    return Settings(sampler, cache, lengths, guidance, {**sources, **length_sources},
                    {**model.generation_defaults.notes, **notes})


@dataclass
class LoopOptions:
    """The loop's switches. `stop_early`: a row ends once its answer is complete (`Layout.finish`); `trace`: a
    record per step (`Batch.trace`); `profile` times every forward into `stats.forward_seconds`; `callback` is
    called after every step with `{"block", "step", "committed"}`; `compile` runs the model compiled
    (`compiled_run`; caches none, prefix, dual); `guidance`: LLaDA's cfg_scale, logits_eos_inf,
    confidence_eos_eot_inf (`Guidance`); `prefix_cache` (a `cache.PrefixBlocks`; block-causal and causal-prefix
    models, cache `block`) fills the store of each canvas laid out (`Batch.lay_out`) with the kept keys and values
    of the rows' finished blocks, and keeps the blocks each block start makes final."""

    stop_early: bool = True
    trace: bool = False
    profile: bool = False
    callback: Callable[[dict], None] | None = None
    compile: bool = False
    guidance: Guidance = field(default_factory=Guidance)
    prefix_cache: PrefixBlocks | None = None
