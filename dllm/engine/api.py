"""The public calls: `generate` (a batch of prompts to answers) and `stream` (one prompt's answer block by block),
both over the one loop, and `likelihood` (an answer's log-likelihood after a prompt); every bad input fails before
any work."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from torch import Tensor

from ..core.checks import check_seed
from ..core.errors import DllmError
from ..models import DiffusionLM
from ..samplers import Daedal
from .canvas import Canvas
from .checks import check_lengths
from .decoding import decoded, new_batch
from .layouts import GrowingCanvas, Row
from .likelihood import elbo
from .logprobs import TokenLogprob, check_logprobs
from .loop import Batch
from .options import LoopOptions, settle
from .stats import Stats
from .text import answer_text, encode_prompts, encode_text, is_token_id, warn_outside_format

if TYPE_CHECKING:
    from ..cache import Cache, PrefixBlocks
    from ..samplers import Sampler


@dataclass
class Generation:
    texts: list[str]
    token_ids: list[list[int]]  # generated ids of each row, cut before the first stop token
    sequences: Tensor  # the final canvas [B, L], prompt included
    stats: Stats
    sampler: dict[str, Any]
    cache: dict[str, Any]
    trace: list[dict] | None = None
    logprobs: list[list[TokenLogprob]] | None = None  # per row, one per token of token_ids (`logprobs=k`)
    settings: dict[str, Any] | None = None  # every setting and where it came from (`Settings.explain`)
    canvas_ids: list[list[int]] | None = None  # each row's whole answer canvas (gen_length tokens, or as gen_length
    # auto grew it), not cut at its first stop token
    answer_spans: list[tuple[int, int]] | None = None  # each row's answer on the canvas [start, end): the positions a
    # trace names


def _prepare(model: DiffusionLM, tokenizer, prompts, sampler, cache, gen_length, block_length, steps, seed, chat,
             flags: dict[str, Any], sampler_args, cache_args, params, guidance: dict[str, Any], max_gen_length):
    """`generate`'s and `stream`'s checks and setup: the settings (`settle`), the seed and flags, then the
    prompts' ids (every bad input fails before any work)."""
    settings = settle(model, sampler, cache, params, sampler_args, cache_args, gen_length, block_length, steps,
                      **guidance, length_args=None if max_gen_length is None else {"max_gen_length": max_gen_length})
    if not isinstance(settings.lengths["gen_length"], Daedal):
        settings.sampler.check_gen_length(settings.lengths["gen_length"])
    for row_seed in seed if isinstance(seed, list) else [seed]:
        check_seed(row_seed)
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise DllmError(f"{name} must be True or False, got {flag!r}")
    ids = encode_prompts(tokenizer, prompts, chat)
    if isinstance(seed, list) and len(seed) != len(ids):
        raise DllmError(f"seed is a list of {len(seed)} seeds for {len(ids)} prompts; give one per prompt or one int")
    length = settings.lengths["gen_length"]  # (ids outside the vocabulary are refused before anything decodes them)
    Canvas.check(model, ids, length.initial_gen_length if isinstance(length, Daedal) else length)
    warn_outside_format(model, tokenizer, ids)
    settings.sampler.prepare(tokenizer)
    return settings, ids


def generate(model: DiffusionLM, tokenizer, prompts, sampler: str | Sampler | None = None,
             cache: str | Cache | None = None, gen_length: int | str | Daedal | None = None,
             block_length: int | None = None,
             steps: int | None = None, seed: int | list[int] = 0, chat: bool | None = None, stop_early: bool = True,
             trace: bool = False, sampler_args: dict[str, Any] | None = None,
             cache_args: dict[str, Any] | None = None, callback: Callable[[dict], None] | None = None,
             compile: bool = False, logprobs: int | None = None, prefix_cache: PrefixBlocks | None = None,
             cfg_scale: float = 0.0, logits_eos_inf: bool = False, confidence_eos_eot_inf: bool = False,
             max_gen_length: int | None = None, **params: Any) -> Generation:
    """Generate answers for a batch of prompts (strings, or lists of token ids).

    `sampler` defaults to the model's (`engine.options.model_sampler`: its generation_config.json's Dream `alg`,
    else its family's (DiffusionGemma: entropy_bound; WeDLM: wedlm, whose gen_length is the authors' max_tokens),
    else `low_confidence`), and so do its parameters
    (`Generation.settings` says where each value came from). `params` go to the sampler or the cache by name (e.g.
    `threshold=0.9`, `temperature=0.5`, `refresh_every=4`); a name both take goes in `sampler_args`/`cache_args`.
    `cfg_scale`, `logits_eos_inf`, `confidence_eos_eot_inf`: LLaDA's generation options, with any sampler
    (`engine.guidance`). Every row draws from its own generator seeded with `seed` (a row equals its prompt
    alone), or with `seed[i]`: several samples of one prompt in one batch take a list of seeds. `cache` defaults
    to `default_cache(model)` (causal models, WeDLM: `frontier`; block-causal and causal-prefix models: `block`;
    others: `none`). gen_length and
    block_length default to the model directory's `generation_config.json`, else the family's (DiffusionGemma:
    256 tokens in canvases), else 64 and 32 (or the largest block below 32 that divides gen_length); steps to
    gen_length (one token per step for schedule-driven samplers; DiffusionGemma: max_denoising_steps per
    canvas; the sampler wedlm takes none, its window decides each step). `gen_length="auto"` lets each answer choose its length (DAEDAL, `samplers.Daedal`: from 64 masks up to
    `max_gen_length`, default 2048 or what the context leaves; a `Daedal` sets its other parameters), decoded with
    sampler threshold unless one is named (`Generation.canvas_ids` holds each answer's canvas). `callback` is called
    after every step (see `decode`). `compile` runs the model under `torch.compile` (caches none, prefix, dual,
    block; the first calls compile, minutes on a CPU for a large model). `logprobs=k` gives every answer token's
    log-probability under the distribution the sampler drew it from, at the step that committed it, with that
    distribution's k most probable tokens
    (`Generation.logprobs`; `dllm.engine.logprobs`). `prefix_cache` (a `dllm.cache.PrefixBlocks`; block-causal
    models, cache `block`) reuses the keys and values of whole blocks an earlier call kept for prompts that start
    the same way (the answers do not change)."""
    check_logprobs(logprobs)
    guidance = dict(cfg_scale=cfg_scale, logits_eos_inf=logits_eos_inf, confidence_eos_eot_inf=confidence_eos_eot_inf)
    settings, ids = _prepare(model, tokenizer, prompts, sampler, cache, gen_length, block_length, steps, seed, chat,
                             dict(stop_early=stop_early, trace=trace, compile=compile), sampler_args, cache_args,
                             params, guidance, max_gen_length)
    batch = decoded(model, ids, settings.sampler, settings.cache, **settings.lengths, seed=seed,
                    stop_early=stop_early, trace=trace, callback=callback, compile=compile, logprobs=logprobs,
                    prefix_cache=prefix_cache, guidance=settings.guidance)
    canvas, stats = batch.canvas, batch.finish()
    cfg = model.config
    spans = answer_spans(batch)
    canvases = [row[a:b] for row, (a, b) in zip(canvas.tokens.tolist(), spans)]
    token_ids = [row[:next((i for i, t in enumerate(row) if t in cfg.stop_ids), len(row))] for row in canvases]
    return Generation([answer_text(tokenizer, ids) for ids in token_ids], token_ids, canvas.tokens, stats,
                      settings.sampler.config(), settings.cache.config(), batch.trace,
                      None if logprobs is None else [batch.logprobs(row) for row in batch.rows], settings.explain(),
                      canvases, spans)


def answer_spans(batch: Batch) -> list[tuple[int, int]]:
    """Each row's answer on the canvas, `[start, end)` (a window's slack past max_tokens left out)."""
    return [(start, start + batch.layout.answer_length(row))
            for start, row in zip(batch.canvas.gen_start.tolist(), batch.rows)]


class Stream:
    """One prompt's answer while it is decoded (`stream`): iterating yields the text each decoded block adds;
    afterwards `generation` holds what `generate` returns for the prompt alone."""

    def __init__(self, tokenizer, batch: Batch, row: Row, settings: dict[str, Any] | None = None):
        self.tokenizer, self.batch, self.row, self.settings = tokenizer, batch, row, settings
        self.generation: Generation | None = None

    def __iter__(self):
        batch, text = self.batch, ""
        while batch.running:
            batch.run_block()
            ids = batch.answer(self.row)
            new = answer_text(self.tokenizer, ids)
            if not batch.running or not new.endswith("\ufffd"):  # a character split between blocks waits
                if new[len(text):]:
                    yield new[len(text):]
                text = new
        if self.generation is None:
            canvas = batch.canvas
            spans = answer_spans(batch)
            self.generation = Generation([text], [ids], canvas.tokens, batch.finish(), batch.sampler.config(),
                                         batch.cache.config(), batch.trace,
                                         None if self.row.logprobs is None else [batch.logprobs(self.row)],
                                         self.settings, [row[a:b] for row, (a, b) in zip(canvas.tokens.tolist(),
                                                                                          spans)], spans)


def stream(model: DiffusionLM, tokenizer, prompt, sampler: str | Sampler | None = None,
           cache: str | Cache | None = None, gen_length: int | None = None, block_length: int | None = None,
           steps: int | None = None, seed: int = 0, chat: bool | None = None, stop_early: bool = True,
           trace: bool = False, sampler_args: dict[str, Any] | None = None,
           cache_args: dict[str, Any] | None = None, callback: Callable[[dict], None] | None = None,
           compile: bool = False, logprobs: int | None = None, cfg_scale: float = 0.0, logits_eos_inf: bool = False,
           confidence_eos_eot_inf: bool = False, max_gen_length: int | None = None, **params: Any) -> Stream:
    """`generate` for one prompt, its answer's text given block by block as it is decoded:

        s = dllm.stream(model, tok, "reverse: abc", sampler="threshold", cache="dual")
        for text in s: print(text, end="", flush=True)
        s.generation.stats.nfe

    The tokens are `generate`'s for that prompt (the same loop); a block's text appears once the block is
    decoded (blocks are final, left to right; WeDLM's window: each step's committed tokens)."""
    one = isinstance(prompt, str) or isinstance(prompt, (list, tuple, Tensor)) and all(is_token_id(t) for t in prompt)
    if not one:
        raise DllmError(f"stream takes one prompt (a string or a list of token ids), got {prompt!r}; "
                        f"use generate for a batch")
    check_logprobs(logprobs)
    guidance = dict(cfg_scale=cfg_scale, logits_eos_inf=logits_eos_inf, confidence_eos_eot_inf=confidence_eos_eot_inf)
    settings, ids = _prepare(model, tokenizer, [prompt], sampler, cache, gen_length, block_length, steps, seed, chat,
                             dict(stop_early=stop_early, trace=trace, compile=compile), sampler_args, cache_args,
                             params, guidance, max_gen_length)
    lengths = settings.lengths
    steps_per_block = check_lengths(lengths["gen_length"], lengths["block_length"], lengths["steps"],
                                    uniform=model.config.mask_id is None)
    auto = isinstance(lengths["gen_length"], Daedal)
    options = LoopOptions(stop_early, trace, callback=callback, compile=compile, guidance=settings.guidance)
    batch = new_batch(model, settings.sampler, settings.cache, lengths["block_length"], steps_per_block, options,
                      GrowingCanvas(lengths["gen_length"]) if auto else None)
    return Stream(tokenizer, batch, batch.add(ids[0], lengths["gen_length"], seed[0] if isinstance(seed, list)
                                              else seed, logprobs=logprobs), settings.explain())


def likelihood(model: DiffusionLM, tokenizer, prompt, answer, chat: bool | None = None, mc_num: int = 128,
               batch_size: int = 32, cfg_scale: float = 0.0, seed: int = 0, convention: str | None = None) -> float:
    """log p(answer | prompt) in nats, as a diffusion model gives it: the Monte Carlo estimate of its lower bound
    (`dllm.engine.likelihood.elbo`: LLaDA's estimator, Dream's on a Dream model; `mc_num` draws, the spread
    shrinking as 1 / sqrt(mc_num); the same for the same `seed`). `prompt` as `generate` takes it (a string,
    wrapped in the chat template unless `chat=False`, or token ids); `answer` a string (its tokens as they are) or
    a list of token ids. Higher is likelier, so it ranks candidate answers:

        {a: dllm.likelihood(model, tok, "reverse: abc12", a) for a in ("#### 21cba", "#### abc12")}"""
    prefix = encode_prompts(tokenizer, [prompt], chat)[0]
    target = encode_text(tokenizer, answer, "the answer") if isinstance(answer, str) else answer
    return elbo(model, prefix, target, mc_num, batch_size, cfg_scale, seed, convention)
