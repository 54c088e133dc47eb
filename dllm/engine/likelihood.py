"""Log-likelihood of a continuation under a masked diffusion model, as LLaDA evaluates its Base models.

A diffusion model gives no exact log p(target | prefix); its evidence lower bound does (LLaDA, arXiv 2502.09992,
Eq. 3 and Algorithm 3; the estimator of LLaDA's `eval_llada.py`):

    log p(y | x) >= E_{l ~ U{1..L}, S ~ l-subsets of the L target positions} [ (L / l) sum_{i in S} log p(y_i | x, y with S masked) ]

estimated by Monte Carlo over `mc_num` draws, `batch_size` draws per forward, the masked counts l stratified over
each batch (evenly spaced from a random start, as LLaDA's code). Cost: `mc_num` rows of `len(prefix) + L`
tokens through the network per continuation (ceil(mc_num / batch_size) forwards); the estimate's spread shrinks as
1 / sqrt(mc_num). Deterministic for a seed. A block-causal model (SDAR) generates block by block, so its bound is
the sum over the target's attention blocks of each block's bound with the blocks before it clean (BD3-LM's NELBO,
arXiv 2503.09573); that costs `mc_num` rows per block. A causal-prefix model (Nemotron-Labs-Diffusion) reads the
continuation as one block being decoded: the context causal, the continuation bidirectional over it.

A Dream model is scored as Dream's own harness scores it (`convention="dream"`, DreamLM/Dream `eval/eval.py`
`_encode_pair` and `_eval_target_nll_mc`, with `add_bos_token=true` as its published multiple-choice runs): BOS
before the prefix and EOS after the target, both never masked, and its estimator of the same bound: per batch of
`batch_size` draws, times t stratified from one uniform, each target token masked with probability
(1 - 1e-3) t + 1e-3, weighted by its inverse; `max(mc_num // batch_size, 1)` batches.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import cache as caches
from .. import samplers
from ..core.checks import check_int, check_seed
from ..core.errors import DllmError
from ..models import DiffusionLM
from ..models.sharded_logits import full_logits, vocabulary_view
from .checks import check_masked
from .guidance import Guidance
from .decoding import decode


def _check(model: DiffusionLM, prefix: list[int], target: list[int]) -> None:
    check_masked(model)
    vocab = model.config.vocab_size
    for name, ids in (("context", prefix), ("continuation", target)):
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                for t in ids):
            raise DllmError(f"the {name} must be a list of token ids in [0, {vocab}), got {ids!r:.80}")
    if not target:
        raise DllmError("the continuation is empty; a likelihood needs at least one continuation token")
    if len(prefix) + len(target) > model.config.max_length:
        fix = "shorten the context" if prefix else "the continuation alone is too long; split it"
        raise DllmError(f"context ({len(prefix)} tokens) + continuation ({len(target)}) exceeds the model's context of "
                        f"{model.config.max_length}; {fix}")


CONVENTIONS = ("llada", "dream")

DREAM_SAMPLING_EPS = 1e-3  # Dream's eval.py `sampling_eps`: the smallest masking probability


def convention_of(model: DiffusionLM) -> str:
    """Whose likelihood harness a model is scored as: Dream's for Dream models, LLaDA's otherwise."""
    return "dream" if model.config.arch == "dream" else "llada"


@torch.no_grad()
def elbo(model: DiffusionLM, prefix: list[int], target: list[int], mc_num: int = 128, batch_size: int = 32,
         cfg_scale: float = 0.0, seed: int = 0, convention: str | None = None, bos_id: int | None = None) -> float:
    """Monte Carlo ELBO of log p(target | prefix) in nats (see the module docstring). `cfg_scale` > 0 applies
    classifier-free guidance against the prefix masked out, as LLaDA's evaluation does. `convention` (default:
    the model's, `convention_of`): "dream" scores `[bos_id] + prefix` and `target + [EOS]` with Dream's
    estimator (no `bos_id`: no BOS)."""
    convention = convention_of(model) if convention is None else convention
    if convention not in CONVENTIONS:
        raise DllmError(f"convention must be one of {', '.join(CONVENTIONS)}, got {convention!r}")
    if convention == "dream":
        prefix, target = ([] if bos_id is None else [bos_id]) + list(prefix), list(target) + [model.config.filler_id]
    _check(model, prefix, target)
    check_int("mc_num", mc_num, 1)
    check_int("batch_size", batch_size, 1)
    check_seed(seed)
    if not isinstance(cfg_scale, (int, float)) or not cfg_scale >= 0:
        raise DllmError(f"cfg_scale must be a number >= 0 (0: no guidance), got {cfg_scale!r}")
    if convention == "dream" and model.config.decoded_keys_fixed:
        raise DllmError(f"Dream's likelihood convention is for bidirectional models; {model.config.arch} is not "
                        f"one: use convention='llada'")
    if model.tp is not None:  # every rank of a tensor-parallel model runs the same forwards
        model.tp.ranks.send(_estimate, model, prefix, target, mc_num, batch_size, cfg_scale, seed, convention)
    return _estimate(model, prefix, target, mc_num, batch_size, cfg_scale, seed, convention)


@torch.no_grad()
def _estimate(model: DiffusionLM, prefix: list[int], target: list[int], mc_num: int, batch_size: int,
              cfg_scale: float, seed: int, convention: str) -> float:
    """`elbo`'s estimate, its arguments checked."""
    if convention == "dream":
        return _dream_elbo(model, prefix, target, mc_num, batch_size, cfg_scale, seed)
    cfg, device = model.config, model.device
    n, length = len(prefix), len(target)
    ends = range(-(-(n + 1) // cfg.block_size) * cfg.block_size, n + length, cfg.block_size) if cfg.block_size else []
    if ends:  # block by block: each block's bound given the blocks before it
        whole, cuts = prefix + target, [n, *ends, n + length]
        return sum(_estimate(model, whole[:a], whole[a:b], mc_num, batch_size, cfg_scale, seed, convention)
                   for a, b in zip(cuts, cuts[1:]))
    sequence = torch.tensor(prefix + target, device=device)
    generator = torch.Generator().manual_seed(seed)
    total = 0.0
    for done in range(0, mc_num, batch_size):
        draws = min(batch_size, mc_num - done)
        start = int(torch.randint(1, length + 1, (), generator=generator))
        counts = torch.linspace(start, start + (draws - 1) * length / draws, draws).round().long()
        counts = (counts - 1) % length + 1  # masked tokens per draw, 1..L
        order = torch.stack([torch.randperm(length, generator=generator) for _ in range(draws)])
        masked = torch.zeros(draws, n + length, dtype=torch.bool)
        masked[:, n:] = order < counts[:, None]
        masked = masked.to(device)
        window = (n, n + length) if cfg.causal_prefix else None
        logits = _guided_logits(model, torch.where(masked, cfg.mask_id, sequence), n, cfg_scale, window)
        nll = F.cross_entropy(logits[masked].float(), sequence.expand(draws, -1)[masked], reduction="none")
        weight = (length / counts.to(device)).repeat_interleave(masked.sum(1))
        total -= float((nll * weight).sum())
    return total / mc_num


def _guided_logits(model: DiffusionLM, noisy: torch.Tensor, prefix_length: int, cfg_scale: float,
                   window: tuple[int, int] | None = None) -> torch.Tensor:
    """The model's logits of `noisy` `[B, L]` (`window`: a causal-prefix model's block being decoded), guided
    against its first `prefix_length` tokens masked (a tensor-parallel model's gathered from its ranks)."""
    logits = full_logits(vocabulary_view(model(noisy, window=window), model))
    if cfg_scale > 0:
        unconditional = noisy.clone()
        unconditional[:, :prefix_length] = model.config.mask_id
        plain = full_logits(vocabulary_view(model(unconditional, window=window), model))
        logits = plain + (cfg_scale + 1) * (logits - plain)
    return logits


def _dream_elbo(model: DiffusionLM, prefix: list[int], target: list[int], mc_num: int, batch_size: int,
                cfg_scale: float, seed: int) -> float:
    """Dream's `_eval_target_nll_mc` (log_type 'ftb'): the first position and the last (BOS, EOS) stay clean."""
    sequence = torch.tensor(prefix + target, device=model.device).expand(batch_size, -1)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(max(mc_num // batch_size, 1)):
        start = torch.rand(1, generator=generator)
        t = (start + torch.arange(batch_size) / batch_size) % 1
        p_mask = ((1 - DREAM_SAMPLING_EPS) * t + DREAM_SAMPLING_EPS)[:, None].expand(-1, sequence.shape[1])
        masked = torch.rand(sequence.shape, generator=generator) < p_mask
        masked[:, 0] = masked[:, -1] = False
        masked[:, :len(prefix)] = False  # only the target is noised
        masked, p_mask = masked.to(model.device), p_mask.to(model.device)
        logits = _guided_logits(model, torch.where(masked, model.config.mask_id, sequence), len(prefix), cfg_scale)
        nll = F.cross_entropy(logits[masked].float(), sequence[masked], reduction="none") / p_mask[masked]
        losses.append(float(nll.sum()) / batch_size)
    return -sum(losses) / len(losses)


@torch.no_grad()
def is_greedy(model: DiffusionLM, prefix: list[int], target: list[int], cfg_scale: float = 0.0) -> bool:
    """Whether decoding the continuation's length after `prefix` one token per step, most confident position
    first (LLaDA's low-confidence remasking, its eval's greedy check, guided with `cfg_scale` as its score),
    gives exactly `target`. A block-causal model decodes in its attention blocks, the canvas rounded up to whole
    blocks."""
    _check(model, prefix, target)
    if not prefix:
        raise DllmError("the greedy check needs a context of at least one token")
    block = model.config.block_size
    length = -(-len(target) // block) * block if block else len(target)
    canvas, _, _ = decode(model, [prefix], samplers.SAMPLERS.create("low_confidence"), caches.CACHES.create("none"),
                          length, block or length, length, stop_early=False, guidance=Guidance(cfg_scale))
    start = int(canvas.gen_start[0])
    return canvas.tokens[0, start:start + len(target)].tolist() == list(target)

