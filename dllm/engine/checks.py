"""Can these decode together? Lengths against blocks, the sampler against the cache and the model, compiling:
each refusal is one line that names the fix, raised before any work."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import samplers as samplers_mod
from ..core.checks import check_int
from ..core.errors import DllmError
from ..models import DiffusionLM
from .guidance import Guidance
from .layouts import GrowingCanvas, check_layout

if TYPE_CHECKING:
    from ..cache import Cache
    from ..samplers import Sampler


def check_lengths(gen_length: int, block_length: int, steps: int | None, model_block: bool = False,
                  uniform: bool = False) -> int:
    """Validate the block layout; return steps per block. `model_block`: the block is a block-causal model's
    attention block, so only gen_length can change. `uniform`: a uniform-state model, whose blocks are denoised
    for their steps and committed at once, so a block may take more steps than it has tokens. gen_length auto
    (`samplers.Daedal`): a block takes block_length steps of a schedule."""
    if isinstance(gen_length, samplers_mod.Daedal):
        check_int("block_length", block_length, 1)
        if steps is not None:
            raise DllmError(f"steps ({steps}) spreads a fixed answer over forwards, and gen_length auto chooses the "
                            f"answer's length while decoding; drop steps")
        return block_length
    check_int("gen_length", gen_length)
    check_int("block_length", block_length)
    if steps is not None:
        check_int("steps", steps)
    if gen_length < 1 or block_length < 1:
        raise DllmError(f"gen_length ({gen_length}) and block_length ({block_length}) must be positive")
    if gen_length % block_length and model_block:
        raise DllmError(f"gen_length ({gen_length}) must be a multiple of the model's attention block "
                        f"({block_length}); e.g. gen_length {-(-gen_length // block_length) * block_length}")
    if gen_length % block_length:
        raise DllmError(f"gen_length ({gen_length}) must be a multiple of block_length ({block_length}); "
                        f"e.g. gen_length {gen_length // block_length * block_length or block_length} "
                        f"or block_length {gen_length}")
    blocks = gen_length // block_length
    steps = gen_length if steps is None else steps
    if uniform and (steps < blocks or steps % blocks):
        raise DllmError(f"steps ({steps}) must be a positive multiple of the number of blocks ({blocks})")
    if not uniform and (steps < blocks or steps > gen_length or steps % blocks):
        raise DllmError(f"steps ({steps}) must be a multiple of the number of blocks ({blocks}) between {blocks} "
                        f"and gen_length ({gen_length})")
    return steps // blocks


def check_masked(model: DiffusionLM) -> None:
    """The model is a masked diffusion model, as a likelihood's ELBO needs (it masks the continuation)."""
    if model.config.mask_id is None:
        raise DllmError(f"{model.config.arch} is a uniform-state model (its canvas starts as random tokens, there is "
                        f"no mask token), and the likelihood here is a masked diffusion ELBO; use a masked diffusion "
                        f"model such as tiny-llada")


def attention_kind(cfg) -> str:
    """How a model whose decoded keys are fixed (`ModelConfig.decoded_keys_fixed`) attends, in a refusal's words."""
    return "block-causal" if cfg.block_size else "causal" if cfg.causal else "causal-prefix"


def check_policies(model: DiffusionLM, sampler: Sampler, cache: Cache, compile: bool = False) -> None:
    """The sampler, the cache and the model can decode together (else the one-line reason)."""
    cfg = model.config
    if cfg.pad_id == cfg.mask_id:
        raise DllmError("the model's pad id equals its mask id; fix pad_token_id in config.json")
    problem = sampler.check_model(cfg)
    if problem is not None:
        raise DllmError(f"sampler {sampler.name!r} cannot decode {cfg.arch}: {problem}")
    if sampler.slides and not cache.follows_window:
        raise DllmError(f"sampler {sampler.name!r} slides its window every step, which cache {cache.name!r} does not "
                        f"follow; use cache frontier (exact, the default) or none")
    if cache.needs_next_commits and not sampler.commits_known_ahead:
        known = ", ".join(cls.name for cls in samplers_mod.SAMPLERS if cls.commits_known_ahead)
        raise DllmError(f"cache {cache.name!r} needs a sampler whose next commits are known before the forward "
                        f"({known}); sampler {sampler.name!r} chooses them from the logits")
    if sampler.drafts and not cache.verifies_drafts:
        raise DllmError(f"sampler {sampler.name!r} verifies drafts, which cache {cache.name!r} cannot do "
                        f"without changing its state; use cache none, prefix, dual or (block-causal models) block")
    if sampler.drafts and getattr(cache, "refresh_every", 0):
        raise DllmError(f"sampler {sampler.name!r} verifies drafts inside a block between cache refreshes; use "
                        f"cache {cache.name!r} with refresh_every=0")
    if sampler.adds_rows and not cache.compiles:
        raise DllmError(f"sampler {sampler.name!r} computes extra rows beside the canvas rows, which cache "
                        f"{cache.name!r} (rows chosen token by token) cannot serve; use cache none, prefix, dual or "
                        f"(block-causal models) block")
    if sampler.adds_rows and not isinstance(model, DiffusionLM):
        raise DllmError(f"sampler {sampler.name!r} computes extra rows beside the canvas rows, which the {cfg.arch} "
                        f"network does not take; use another sampler")
    if sampler.reads_decoded_logits and not cache.covers_window:
        raise DllmError(f"sampler {sampler.name!r} reads the logits of decoded tokens, which cache {cache.name!r} does "
                        f"not compute; use cache none, prefix or dual")
    if cache.block_causal_only and not cfg.decoded_keys_fixed:
        raise DllmError(f"cache {cache.name!r} is exact only under block-causal attention ({cfg.arch} attends to the "
                        f"whole canvas); use prefix or dual")
    if sampler.edits and not cache.block_fresh:
        raise DllmError(f"sampler {sampler.name!r} rewrites decoded tokens, whose keys and values cache "
                        f"{cache.name!r} keeps; use cache none, prefix, dual or (block-causal models) block")
    kind = attention_kind(cfg)
    if cfg.decoded_keys_fixed and sampler.commits_past_block:
        raise DllmError(f"sampler {sampler.name!r} commits later blocks from one forward, which a {kind} model "
                        f"({cfg.arch}) predicts only from finished blocks; use another sampler")
    if cfg.decoded_keys_fixed and not cache.block_fresh:
        exact = "frontier (exact), block" if cfg.causal else "block (exact)"
        raise DllmError(f"cache {cache.name!r} chooses rows for full attention; on a {kind} model "
                        f"({cfg.arch}) use cache {exact}, none, prefix or dual")
    check_compile(cache, compile)
    if compile and cfg.moe is not None and model.dtype != torch.bfloat16:
        raise DllmError(f"MoE layers ({cfg.arch}) compile in bfloat16 only (torch's grouped matmul traces for no "
                        f"other type); use --dtype bfloat16 or drop --compile")


def check_prefix_cache(model: DiffusionLM, cache: Cache, prefix_cache, guidance: Guidance) -> None:
    """A prefix cache (`cache.PrefixBlocks`) is made for this model, filled through the cache's store, and not
    asked to keep guided rows."""
    if prefix_cache is None:
        return
    if not cache.keeps_final_blocks:
        raise DllmError(f"a prefix cache reuses the finished blocks' keys and values that cache 'block' keeps; cache "
                        f"{cache.name!r} recomputes them: use cache block or no prefix cache")
    if prefix_cache.model is not model:
        raise DllmError("this prefix cache holds another model's keys and values; make one per model")
    if guidance.guided:
        raise DllmError("a prefix cache keeps the keys and values of guided rows only; with cfg_scale drop the "
                        "prefix cache")


def check_guidance(model: DiffusionLM, sampler: Sampler, cache: Cache, guidance: Guidance) -> None:
    """LLaDA's generation options (`Guidance`) against the model, the sampler and the cache (else the one-line
    reason)."""
    if guidance.guided and model.config.mask_id is None:
        raise DllmError("cfg_scale masks the prompt for the unconditional copy, and this is a uniform-state model "
                        "(no mask token); use cfg_scale=0")
    if guidance.guided and cache.reads_model_outputs:
        raise DllmError(f"cache {cache.name!r} chooses a row's recomputed rows from the model's attention and "
                        f"predictions, which cfg_scale splits between the row and its unconditional copy; use cache "
                        f"none, prefix, dual, dkv, dkv_greedy or dllm_cache, or cfg_scale=0")
    if guidance.guided and cache.rows_coupled:
        raise DllmError(f"cache {cache.name!r} refreshes every row of a batch where any row drifts, so with cfg_scale "
                        f"the unconditional copies would steer the guided rows' refreshes; use cache none, prefix, "
                        f"dual, dkv or dkv_greedy, or cfg_scale=0")
    if guidance.confidence_eos_eot_inf and not sampler.orders_by_token_probability:
        known = ", ".join(cls.name for cls in samplers_mod.SAMPLERS if cls.orders_by_token_probability)
        raise DllmError(f"confidence_eos_eot_inf scores EOS and EoT predictions 0 in the token probability a sampler "
                        f"orders by; sampler {sampler.name!r} orders by its own score; use one of {known}")


def check_auto_length(model: DiffusionLM, sampler: Sampler, cache: Cache, compile: bool, guidance: Guidance
                      ) -> None:
    """gen_length auto (DAEDAL, `samplers.Daedal`) can decode with this model, sampler, cache and options (else the
    one-line reason)."""
    cfg, why = model.config, None
    if cfg.mask_id is None:
        why = f"inserts masks, and {cfg.arch} is a uniform-state model (no mask token)"
    elif cfg.decoded_keys_fixed:
        why = (f"inserts masks that move decoded tokens, whose keys and values {cfg.arch} fixes once decoded "
               f"({attention_kind(cfg)} attention)")
    elif not sampler.canvas_may_grow:
        known = ", ".join(cls.name for cls in samplers_mod.SAMPLERS if cls.canvas_may_grow)
        why = (f"inserts masks between the steps of sampler {sampler.name!r}, which keeps state per position or "
               f"plans ahead; use one of {known}")
    elif cache.stores_kv:
        why = (f"moves the columns whose keys and values cache {cache.name!r} keeps, and reads every answer "
               f"position's logits at each step; use cache none")
    elif compile:
        why = "changes the canvas's width as it grows, so a compiled forward would compile again; drop compile"
    elif guidance.logits_eos_inf:
        why = "grows the answer until EOS is likely, and logits_eos_inf bans EOS; drop logits_eos_inf"
    if why is not None:
        raise DllmError(f"gen_length auto (DAEDAL) {why}")


def check_block_layout(model: DiffusionLM, block_length: int) -> None:
    size = model.config.block_size
    if size and block_length != size:
        raise DllmError(f"block_length ({block_length}) must equal the model's attention block ({size}) on a "
                        f"block-causal model ({model.config.arch}); use --block-length {size}")


def check_compile(cache: Cache, compile: bool) -> None:
    if compile and not cache.compiles:
        raise DllmError(f"cache {cache.name!r} chooses its rows token by token and runs eagerly; drop --compile "
                        f"(compile=False) or use cache none, prefix, dual or (block-causal models) block")


def check_batch(model: DiffusionLM, sampler: samplers_mod.Sampler, cache, block_length: int, options, layout) -> None:
    """Everything a `Batch` refuses before any work: its layout, sampler and cache on this model, gen_length auto,
    LLaDA's guidance options, the block layout and the prefix cache (`options`: its `LoopOptions`)."""
    check_layout(sampler, layout)
    check_policies(model, sampler, cache, options.compile)
    if isinstance(layout, GrowingCanvas):
        check_auto_length(model, sampler, cache, options.compile, options.guidance)
    check_guidance(model, sampler, cache, options.guidance)
    check_block_layout(model, block_length)
    check_prefix_cache(model, cache, options.prefix_cache, options.guidance)
