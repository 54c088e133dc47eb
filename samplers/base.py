"""Sampler interface (`StepContext` -> `Commit`) and the helpers the built-in samplers share.

Deliberate difference from every reference sampler (ML-GSAI/LLaDA `generate`, NVlabs/Fast-dLLM
`get_transfer_index` / `get_transfer_index_dynamic`, Dream `_sample` / `sample_tokens`): the decode loop sets the
MASK token's logit to -inf before a sampler sees the logits (`dllm/engine/runner.py`), so MASK is never proposed and
confidences are softmax probabilities over the other tokens. The references use the full vocabulary: they can
propose MASK, and "committing" it leaves the position masked."""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor

from dllm.core.params import Params, Registry, is_numeric, param, type_hints
from dllm.models.sharded_logits import ShardedLogits


@dataclass
class StepContext:
    """What a sampler sees at one step. Candidates are the positions of the current block; logits are
    already aligned to them (no sampler ever sees Dream's shift)."""

    logits: Tensor  # [B, C, V] logits of the candidate positions (the block, or the sampler's logit_window)
    eligible: Tensor  # [B, C] bool: masked (not yet committed), inside the current block, row unfinished
    masked: Tensor  # [B, C] bool: masked (not yet committed) and row unfinished, anywhere in the window
    positions: Tensor  # [C] canvas positions of the candidates
    canvas: Tensor  # [B, L] current tokens (read only)
    step: int  # step index inside the block, from 0
    steps: int  # step budget of this block (used by schedule-driven samplers)
    block: int  # block index, from 0
    generators: list[torch.Generator | None]  # one per row (None: nothing eligible this step): a row's random draws
    # never depend on the rows beside it
    nfe: int  # forwards run before the one that produced these logits
    total_steps: int  # nominal step budget of the generation (steps, default gen_length)
    block_start: int  # canvas position where the block starts
    block_end: int  # ... and ends (exclusive)
    prompt_length: int  # canvas position where the generation starts
    state: SimpleNamespace  # this generation's sampler state (e.g. credits), owned by the loop: fresh per run, so
    # one sampler object can decode many batches at once
    forward: Callable[..., Tensor] | None = None  # drafts [B, K, C] (, tree: by tree attention) -> the next step's
    # logits [B, K, C, V] on each draft, in one counted forward (self-speculative verification; samplers with
    # `drafts = True`)
    editable: Tensor | None = None  # [B, C] bool: decoded answer tokens of the current block, unfinished rows
    # (samplers with `edits = True`; never the prompt or another block)
    family: str = "llada"  # "llada" (aligned logits) or "dream" (shifted), for defaults the papers set per family
    config: Any = None  # the model's `ModelConfig`: its special ids (mask, stops, edit tokens)
    unscored: Tensor | None = None  # LLaDA's `confidence_eos_eot_inf`: the token ids (or a `[B, V]` mask, each row's
    # own) that `token_probability` scores as if their logit were -inf; None: off. Pass it to `token_probability`
    extra_logits: Tensor | None = None  # [B, E, V] logits of the sampler's `extra_rows` (samplers with `adds_rows`),
    # each extra row's own (on a shifted model, Dream, a row scores the column after its own)


@dataclass
class ExtraRows:
    """Rows a forward computes beside the canvas rows (`Sampler.extra_rows`: WINO's shadow block; the drafts of
    tree-attention verification). No canvas row attends to them and their keys and values are never stored. Each
    sees the canvas columns and the extra rows its masks name, and never more than a canvas row at its column sees
    (padding, block-causal attention)."""

    tokens: Tensor  # [B, E] input ids
    columns: Tensor  # [E] the canvas column each stands at: its RoPE position is that column's
    sees_canvas: Tensor  # [B or 1, E, L] bool: the canvas columns each attends to
    sees_extra: Tensor  # [E, E] bool: the extra rows each attends to
    wanted: Tensor | None = None  # [E'] the extra rows whose logits are needed (None: every one)

    def take_rows(self, index: Tensor) -> "ExtraRows":
        """The extra rows of the batch rows `index` alone."""
        sees = self.sees_canvas if len(self.sees_canvas) == 1 else self.sees_canvas[index]
        return replace(self, tokens=self.tokens[index], sees_canvas=sees)


@dataclass
class Commit:
    mask: Tensor  # [B, C] bool: positions to commit (masked ones; >= 1 eligible per row that has any)
    tokens: Tensor  # [B, C] long: the token for each committed position
    confidence: Tensor  # [B, C] float: the score the choice was made on (for traces)
    verified: Tensor | None = None  # [B] long: the draft (from ctx.forward) these commits produce; its logits
    # become the next step's, so that step needs no forward
    edit: Tensor | None = None  # [B, C] bool: editable positions rewritten with `tokens` (token editing); the mask
    # token re-masks a position (WINO's narrow-out): it is not yet committed again
    again: Tensor | None = None  # [B] bool: rows that want another step of this block even with no mask left
    draft: Tensor | None = None  # [B, C] long: the next tokens of the uncommitted positions not committed now (a
    # uniform-state canvas, renoised)
    logits: Tensor | None = None  # [B, C, V] the logits the tokens were drawn from when they are not the step's
    # (CreditDecoding's fused logits); `log_distribution` of them is what `logprobs` reports
    given_up: Tensor | None = None  # [B, C] bool: masked positions given up for good (DUS's remasking): they stay
    # masked in the answer, and the block ends without them


@dataclass
class Sampler(Params):
    """Base class. Subclasses implement `step`."""

    drafts: ClassVar[bool] = False  # calls ctx.forward (the cache must be able to verify drafts)
    commits_known_ahead: ClassVar[bool] = False  # `next_commits` names the next step's commits (dKV-Cache-Greedy)
    block_local: ClassVar[bool] = True  # decides from the current block alone (state reset per block; no use of
    # prompt_length, nfe or total_steps), so rows at different blocks can share a batch (`dllm serve`)
    edits: ClassVar[bool] = False  # rewrites decoded tokens of the current block (`Commit.edit`, `Commit.again`)
    moves_tokens: ClassVar[bool] = False  # its edits move decoded tokens to other positions (insert/delete)
    commits_past_block: ClassVar[bool] = False  # may commit masks of later blocks (Prophet's early exit)
    reads_decoded_logits: ClassVar[bool] = False  # reads logits of decoded positions of its window (Prophet's gap)
    may_commit_nothing: ClassVar[bool] = False  # a step before the block's last may commit nothing (Dream's origin)
    leaves_masks: ClassVar[bool] = False  # may give positions up (`Commit.given_up`), so an answer may hold masks
    batch_params: ClassVar[tuple[str, ...]] = ()  # numeric parameters the rows of a batch share (they set the logits
    # the batch computes); the others may differ per row (`stack_rows`)
    adds_rows: ClassVar[bool] = False  # its forwards compute `extra_rows` beside the canvas rows (WINO's shadow block)
    canvas_may_grow: ClassVar[bool] = False  # keeps nothing per position from step to step and proposes a token at
    # every eligible position (`Commit.tokens`), so masks may be inserted between its steps (gen_length auto, DAEDAL)
    orders_by_token_probability: ClassVar[bool] = True  # commits in the order of `token_probability` (or at random),
    # so LLaDA's `confidence_eos_eot_inf` (`StepContext.unscored`, passed to `token_probability`) reaches its choice
    reads_shards: ClassVar[bool] = False  # reads the logits only through this module's helpers (`gumbel_argmax`,
    # `token_probability`, `token_entropy`, `tempered`), indexing of positions, `.argmax(-1)` and `.topk(k, -1)`:
    # on a tensor-parallel model it gets each rank's vocabulary columns (`ShardedLogits`, statistics merged over the
    # ranks) instead of the whole logits gathered on every rank
    slides: ClassVar[bool] = False  # decodes in a window that slides every step (WeDLM), on
    # `engine.layouts.SlidingWindow`, the only layout it runs on
    temperature: float = param(0.0, "sampling temperature (0 = greedy)", ge=0.0)

    def step(self, ctx: StepContext) -> Commit:
        raise NotImplementedError

    def log_distribution(self, logits: Tensor) -> Tensor:
        """Hook: the `[B, C, V]` log-probabilities of the distribution each token was drawn from, given the logits
        it was drawn from (`Commit.logits`, else the step's): softmax(logits / T), the plain softmax at T = 0 (the
        argmax of the model's distribution). What `logprobs=k` reports for each committed token."""
        return tempered(logits.float(), self.temperature).log_softmax(-1)

    @classmethod
    def row_params(cls) -> list[str]:
        """The parameters that may differ between the rows of one batch: the numeric ones, less `batch_params`
        (a bool or a string chooses the rule itself)."""
        hints = type_hints(cls)
        return [name for name in cls.param_names() if is_numeric(hints[name]) and name not in cls.batch_params]

    def batch_key(self) -> tuple:
        """What the rows of one batch share: the sampler and its parameters that are not per row (`dllm serve`
        batches requests whose keys, and caches, are equal)."""
        rows = self.row_params()
        return (self.name, *((k, v) for k, v in self.config().items() if k != "name" and k not in rows))

    def prepare(self, tokenizer) -> None:
        """Hook, called by `dllm.generate` before decoding: read what the sampler needs from the tokenizer."""

    def check_gen_length(self, gen_length: int) -> None:
        """Hook, called before decoding: refuse (one-line `DllmError`) an answer of `gen_length` tokens that this
        sampler's parameters do not fit."""

    def logit_window(self, prompt_length: int, length: int, start: int, end: int, step: int) -> tuple[int, int]:
        """Hook: canvas range `[lo, hi)` whose logits this step needs (default: the block). The loop widens
        the computed rows to cover it, and counts them (dkv, dkv_greedy and elastic compute only the rows of
        positions that may be committed; the others, served from the store, get zero logits). The step sees the
        logits of the window and the block; a block position outside the window (a first position committed at
        the block's first step) is scored by whatever row the cache computed, so it must be committed already."""
        return start, end

    def next_commits(self, state: SimpleNamespace) -> Tensor | None:
        """Hook of samplers with `commits_known_ahead`: the `[B, L]` canvas positions the next step will commit,
        fixed by the last `step` (kept in `state`), before that step's forward."""
        return None

    def check_model(self, config: Any) -> str | None:
        """Hook: why this sampler cannot decode a model with this `ModelConfig` (None: it can). Default: a masked
        model."""
        if config.mask_id is None:
            return ("it commits masked positions, and this is a uniform-state model (no mask: its canvas starts as "
                    "random tokens); use sampler entropy_bound")
        return None

    def fill_block(self, shape: tuple[int, int], generators: list[torch.Generator | None], config: Any
                   ) -> Tensor | None:
        """Hook, called before a block's first forward: the `[B, C]` tokens its uncommitted positions start from,
        row b's drawn from `generators[b]` (None: the row draws nothing), or None: they hold the mask."""
        return None

    def model_inputs(self, state: SimpleNamespace, step: int) -> dict | None:
        """Hook: further keywords of the model's `run` for the forward of `step` (DiffusionGemma's
        self-conditioning), from this generation's sampler state."""
        return None

    def extra_rows(self, canvas: Tensor, start: int, end: int, config: Any) -> ExtraRows | None:
        """Hook of samplers with `adds_rows`: the rows the forward of a step of block `[start, end)` computes beside
        the canvas rows, given the `[B, L]` canvas; their logits are the step's `ctx.extra_logits`."""
        return None

    def block_end(self, ctx: StepContext) -> int:
        """Hook, called after each block-start forward: where this block ends (AdaBlock)."""
        return ctx.block_end

    def block_origin(self, prompt_length: int, block_length: int) -> int:
        """Hook: where a row's first block starts, counted from its first prompt token (default: where its answer
        starts). An earlier start makes the first block overlap the prompt's tail, whose tokens stay as they are
        (dInfer's absolute block alignment); a block-causal model's own attention blocks take precedence."""
        return prompt_length


SAMPLERS = Registry("sampler", Sampler)  # the samplers by name
register = SAMPLERS.register


def stack_rows(samplers: list[Sampler]) -> Sampler:
    """One sampler for rows with their own settings (samplers equal in `batch_key`, one per row): the first, with
    each per-row parameter whose value differs between rows as a `[B]` float64 tensor on the CPU (NaN where a row
    has None); a sampler it holds (Prophet's base) is stacked too. Steps read such a parameter through `per_row` or
    `each_value`. Rows that all agree get the first sampler itself, so a batch of one setting decodes as before."""
    first = samplers[0]
    differ = [name for name in first.row_params() if len({getattr(s, name) for s in samplers}) > 1]
    if not differ:
        return first
    stacked = copy.copy(first)
    for name in differ:
        setattr(stacked, name, torch.tensor([math.nan if getattr(s, name) is None else getattr(s, name)
                                             for s in samplers], dtype=torch.float64))
    for name, value in vars(first).items():
        if isinstance(value, Sampler):
            setattr(stacked, name, stack_rows([getattr(s, name) for s in samplers]))
    return stacked


def per_row(value: Any, like: Tensor) -> Any:
    """A parameter as an operand of `like` (`[B, ...]`): a number as it is; per-row values (`stack_rows`) as
    `[B, 1, ...]` in `like`'s dtype and device, the number a Python float becomes in an op with `like`, so that
    every row computes what it computes alone."""
    if not isinstance(value, Tensor):
        return value
    return value.to(like.device, like.dtype).view(-1, *[1] * (like.dim() - 1))


def row_values(value: Any, rows: int) -> list:
    """A parameter's value for each of `rows` rows, as Python numbers (None where a row has None)."""
    if not isinstance(value, Tensor):
        return [value] * rows
    return [None if math.isnan(v) else v for v in value.tolist()]


def each_value(value: Any, compute: Callable[[Any], Tensor]) -> Tensor:
    """`compute(value)` `[B, ...]` for a number; for per-row values, `compute` of each distinct value over the whole
    batch, every row keeping its own value's result: the rows grouped by value, for a parameter that sets a shape
    or a branch (a pooling radius, None for off) or whose tensor operand rounds unlike a number (a power)."""
    if not isinstance(value, Tensor):
        return compute(value)
    values, out = row_values(value, len(value)), None
    for v in dict.fromkeys(values):
        result = compute(v)
        own = torch.tensor([x == v for x in values], device=result.device).view(-1, *[1] * (result.dim() - 1))
        out = result if out is None else torch.where(own, result, out)
    return out


def tempered(logits: Tensor, temperature: Any) -> Tensor:
    """`logits / T`, per row where temperatures differ; rows at T = 0 or None (greedy) keep their logits."""
    if isinstance(temperature, Tensor):
        return logits / per_row(temperature.masked_fill(~(temperature > 0), 1.0), logits)
    return logits / temperature if temperature else logits


def uniform(shape: torch.Size, generators: list[torch.Generator | None], device: torch.device) -> Tensor:
    """float64 uniforms of `shape` `[B, ...]`, row b drawn from `generators[b]` (zeros for a row with nothing to
    decode this step, None): a row gets the numbers it would get alone."""
    return torch.stack([torch.zeros(shape[1:], dtype=torch.float64, device=device) if g is None else
                        torch.rand(shape[1:], dtype=torch.float64, device=device, generator=g) for g in generators])


def gumbel_argmax(logits: Tensor, temperature: Any, generators: list[torch.Generator | None]) -> Tensor:
    """Sample from softmax(logits / T) as argmax(logits + T * Gumbel), in float64 (ML-GSAI/LLaDA
    `add_gumbel_noise`; low-precision noise lowers the effective temperature). T = 0 is plain argmax and
    draws no random numbers (per row, where rows have their own temperatures)."""
    if not isinstance(temperature, Tensor) and temperature == 0:
        return logits.argmax(-1)
    generators = [g if t else None for g, t in zip(generators, row_values(temperature, len(generators)))]
    u = uniform(logits.shape, generators, logits.device)
    gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
    return (logits.double() + per_row(temperature, gumbel) * gumbel).argmax(-1)


def token_probability(logits: Tensor, tokens: Tensor, unscored: Tensor | None = None) -> Tensor:
    """Softmax probability of `tokens` under the (noise-free) logits: the softmax in fp32, gathered, as
    ML-GSAI/LLaDA `generate.py` and NVlabs/Fast-dLLM compute their confidences (Fast-dLLM in fp64), so that
    near-tied confidences order as theirs do (`tests/test_reference_rules.py`). `unscored` (the step's
    `StepContext.unscored`, LLaDA's `confidence_eos_eot_inf`): token ids (EOS, EoT; or a `[B, V]` mask, each row's
    own) scored as if their logit were -inf, so a position predicting one of them gets probability 0 and the
    others' probabilities leave out their mass (ML-GSAI/LLaDA `generate.py`)."""
    if isinstance(logits, ShardedLogits):
        return logits.token_probability(tokens, unscored)
    logits = logits.float()
    if unscored is not None and unscored.dim() == 2:  # a mask per row
        logits = logits.masked_fill(unscored.view(len(unscored), *[1] * (logits.dim() - 2), -1), float("-inf"))
    elif unscored is not None:
        logits = logits.index_fill(-1, unscored, float("-inf"))
    return logits.softmax(-1).gather(-1, tokens[..., None])[..., 0]


def top_k_per_row(confidence: Tensor, eligible: Tensor, k: Tensor) -> Tensor:
    """Commit the `k[b]` most confident eligible positions of each row; ties go to the lowest position."""
    score = confidence.double().masked_fill(~eligible, float("-inf"))
    order = score.sort(dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
    k = torch.minimum(k, eligible.sum(1))
    return (rank < k[:, None]) & eligible


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy (nats) of softmax(logits) over the last dimension, in float32 (a -inf logit counts 0)."""
    if isinstance(logits, ShardedLogits):
        return logits.entropy()
    logp = logits.float().log_softmax(-1)
    return -(logp.exp() * logp.clamp(min=torch.finfo(logp.dtype).min)).sum(-1)


def entropy_bounded(entropy: Tensor, eligible: Tensor, bound: Any, score: Tensor | None = None,
                    sdar: bool = False) -> Tensor:
    """The entropy bound of EB-Sampler (arXiv 2505.24857), shared by `eb_sampler`, SDAR's `entropy_bounded` and
    DiffusionGemma's `entropy_bound`: `[B, C]` bool, the eligible positions ranked first by `score` (descending;
    default: the lowest entropy first), as many as there are positions whose entropies ranked before them sum to at
    most `bound` (ranked by entropy, the paper's `sum_U H - max_U H <= gamma`; computed as every port computes it,
    the running sum less the position's own), at least one per row with any eligible; ties go to the lowest
    position. `sdar`: JetAstra's engine's reading instead, the running sum with the position's own entropy
    strictly below `bound`."""
    score = -entropy if score is None else score
    order = score.double().masked_fill(~eligible, float("-inf")).sort(dim=1, descending=True, stable=True).indices
    ranked_eligible = eligible.gather(1, order)
    ranked = entropy.gather(1, order).masked_fill(~ranked_eligible, float("inf"))
    total = ranked.cumsum(1)
    bound = per_row(bound, ranked)
    count = (total < bound if sdar else total - ranked <= bound).sum(1, keepdim=True).clamp(min=1)
    chosen = ranked_eligible & (torch.arange(order.shape[1], device=order.device) < count)
    return torch.zeros_like(eligible).scatter(1, order, chosen)


def most_confident(confidence: Tensor, eligible: Tensor) -> Tensor:
    """`top_k_per_row` with k = 1 in a third of the tensor ops: the most confident eligible position of each row
    `[..., C]` with any (argmax takes the first of equal maxima, so ties go to the lowest position)."""
    best = confidence.masked_fill(~eligible, float("-inf")).argmax(-1, keepdim=True)
    return torch.zeros_like(eligible).scatter_(-1, best, True) & eligible


def quota(ctx: StepContext) -> Tensor:
    """LLaDA's linear schedule as a running quota: ceil(masks left / steps left), which reproduces
    `get_num_transfer_tokens` (equal shares, the larger ones first); the last step takes the rest."""
    left = ctx.eligible.sum(1)
    steps_left = max(ctx.steps - ctx.step, 1)
    return (left + steps_left - 1) // steps_left


@dataclass
class CausalFirst(Sampler):
    """A selection rule (`choose`) with NVIDIA's causal first token as an option (`causal_first`;
    Nemotron-Labs-Diffusion's `generate_with_prefix_cache_block_diff(causal_context=True)`): a block starts with
    its first position set to the causal next-token prediction, and the rule denoises the rest.

    Step 0 reads one more row, the one before the block (`logit_window`); the loop computes it causally (it lies
    outside the block), so its logits are the causal prediction after the prompt's last token or the finished
    block's (whose keys and values that forward re-encodes causally: NVIDIA's commit forward folded in). Step 0
    commits only the block's first position, drawn from that row; from step 1 on the rule runs one step late,
    so its schedule spreads the remaining masks over the block's `steps` as NVIDIA's does (steps left
    `steps - step + 1`)."""

    reads_shards: ClassVar[bool] = True

    causal_first: bool = param(False, "commit each block's first token from the causal next-token prediction at "
                                      "its first step (Nemotron-Labs-Diffusion's causal_context)")

    def choose(self, ctx: StepContext) -> Commit:
        """The selection rule at one step."""
        raise NotImplementedError

    def step(self, ctx: StepContext) -> Commit:
        if not self.causal_first:
            return self.choose(ctx)
        if ctx.step > 0:
            return self.choose(replace(ctx, step=ctx.step - 1))
        causal = ctx.logits[:, :1]  # the row before the block
        drawn = gumbel_argmax(causal, self.temperature, ctx.generators)  # [B, 1]
        width = ctx.positions.shape[0]
        return Commit(ctx.eligible & (ctx.positions == ctx.block_start), drawn.expand(-1, width),
                      token_probability(causal, drawn, ctx.unscored).expand(-1, width),
                      logits=causal.expand(-1, width, -1))

    def logit_window(self, prompt_length: int, length: int, start: int, end: int, step: int) -> tuple[int, int]:
        return (start - 1, end) if self.causal_first and step == 0 else (start, end)

    def check_model(self, config: Any) -> str | None:
        if self.causal_first and not (config.causal_prefix and not config.logit_shift):
            return ("causal_first reads the causal next-token prediction of the row before each block, which only a "
                    "causal-prefix model (Nemotron-Labs-Diffusion) computes; drop causal_first")
        return super().check_model(config)
