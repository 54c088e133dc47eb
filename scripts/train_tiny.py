"""Train a tiny LLaDA, Dream, SDAR, DiffusionGemma or WeDLM on the synthetic task suite with its diffusion objective.

LLaDA SFT (arXiv 2502.09992, section 2.3): per sequence t ~ U(eps, 1); every answer position (the answer, its
end-of-turn token and the end-of-text padding up to the answer length) is masked with probability t; the prompt is
never masked; loss = sum over masked positions of CE / t, divided by the answer length. Dream trains the same way
through its shifted logits (hidden i-1 predicts token i), which `DiffusionLM.run` handles via `logit_rows`.

SDAR (`--arch sdar`, block-causal attention in blocks of `--block-size` RoPE positions) trains with the
block-diffusion objective (`block_diffusion_loss`): a noise level t ~ U(eps, 1) per attention block of the answer,
and the noisy copy of the sequence attends to the clean copy's earlier blocks in the same forward.

    python scripts/train_tiny.py --arch llada --out runs/tiny-llada --steps 4800 --train-per-family 40000 --bf16 --threads 1

(about 2 hours on one CPU thread; add `--device cuda` on a GPU; README gives the exact commands behind the
shipped weights.) Recipe choices for a CPU budget: families are sampled with weights (`--mix`, the
dependency-heavy ones more often), the answer canvas of a batch is 48..64 tokens (each batch pays for what it
needs, every position up to 64 still learns to stay padding), RoPE theta 10000 (a 100-token context needs no
longer wavelengths), and `--bf16` autocast (about 25% faster per step on an AVX512-BF16 CPU).

DiffusionGemma (`--arch dgemma`, uniform-state: no mask token) trains with the uniform-noise objective
(`uniform_noise_loss`): the answer fills one canvas of `--canvas-length` tokens, each replaced by a uniformly
random token with probability t ~ U(eps, 1), loss = CE over the whole canvas; the prompt is encoded causally and
the canvas decoded bidirectionally over it, in one forward, as the engine decodes. Self-conditioning (Chen et
al., arXiv 2208.04202, as DiffusionGemma's decoder takes it): half of the steps first run a no-grad pass whose
temperature-scaled logits condition the trained pass.

WeDLM (`--arch wedlm`, a Qwen3-shaped causal network) trains with its dual-stream objective (`wedlm_loss`, spec
`wedlm.md` section 4): the clean sequence (plain causal, an AR next-token loss on the answer) and in the same
forward a noisy copy whose blocks of `--block-size` positions each mask round(n * gamma) answer tokens, gamma ~ U(0,
1) per block, are reordered unmasked-then-masked and attend causally within the block and to the clean earlier
blocks; the masked loss scores each mask at its own row, weighted 1/gamma; the two losses are averaged.

Seeded and resumable: the run state (weights, optimizer moments, step) is saved as safetensors + JSON under
`--state` (default `runs/train-ARCH`) every `--save-every` steps and picked up again when the same command is rerun.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, load_model, save_file, save_model
from tqdm import tqdm

import dllm
from dllm import cache as caches
from dllm import samplers as samplers_mod
from dllm.engine import decode, generate
from dllm.eval.synthetic import CHARSET, FAMILIES, LIST_FAMILIES, make_split, score, training_format
from dllm.models import ARCHITECTURES_BY_NAME, ModelConfig
from dllm.models.checkpoint import save_pretrained
from dllm.models.gemma import GemmaConfig
from dllm.models.generation import read_generation_config
from dllm.models.loading import build_model, init_random
from dllm.models.moe import MoEConfig
from dllm.models.tokenizer import build_tokenizer

END_OF_TURN = {"llada": "<|eot_id|>", "dream": "<|im_end|>", "sdar": "<|im_end|>", "dgemma": "<|eot_id|>",
               "wedlm": "<|im_end|>"}
# SDAR, WeDLM: the Qwen chat format; DiffusionGemma: the format its `random:` presets get
TOKENIZER_STYLE = {"llada": "llada", "dream": "dream", "sdar": "dream", "dgemma": "llada", "wedlm": "dream"}


def model_config(arch: str, tok, size: dict, rope_theta: float, block_size: int = 4) -> ModelConfig:
    """LLaDA: Llama layout; Dream: Qwen2 (q/k/v bias, shifted logits); SDAR: Qwen3 (per-head q/k norm, no bias)
    with block-causal attention in blocks of `block_size`; WeDLM: Qwen3 with causal attention."""
    eos, eot = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids(END_OF_TURN[arch])
    qwen3 = dict(head_size=size["d"] // size["heads"], qk_norm=True)
    layout = {"sdar": dict(**qwen3, block_size=block_size), "wedlm": dict(**qwen3, causal=True)}.get(arch, {})
    return ModelConfig(arch=arch, vocab_size=len(tok), hidden_size=size["d"], intermediate_size=size["ff"],
                       n_layers=size["layers"], n_heads=size["heads"], n_kv_heads=size["kv_heads"],
                       rms_norm_eps=1e-5 if arch == "llada" else 1e-6,
                       rope_theta=rope_theta, qkv_bias=arch == "dream",
                       logit_shift=int(arch == "dream"), mask_id=tok.mask_token_id, pad_id=eos,
                       stop_ids=tuple(sorted({eos, eot})), filler_id=eos, max_length=256, **layout)


def dgemma_config(tok, size: dict, rope_theta: float, canvas_length: int) -> GemmaConfig:
    """DiffusionGemma's layout at tiny size: sliding layers with a window longer than any sequence here and the
    last layer full (transformers' rule), head size d/heads in both kinds, and the smallest mixture of experts
    beside each dense GeGLU (4 experts of width d/2, top 1: the network needs one, the tasks do not)."""
    eos, eot = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids(END_OF_TURN["dgemma"])
    head_size = size["d"] // size["heads"]
    moe = MoEConfig(n_experts=4, top_k=1, expert_size=size["d"] // 2, router="gemma", normalize=True,
                    activation="gelu_tanh")
    return GemmaConfig(arch="diffusion_gemma", vocab_size=len(tok), hidden_size=size["d"],
                       intermediate_size=size["ff"], n_layers=size["layers"], n_heads=size["heads"],
                       n_kv_heads=size["kv_heads"], rms_norm_eps=1e-6, rope_theta=rope_theta, qkv_bias=False,
                       logit_shift=0, mask_id=None, pad_id=eos, stop_ids=tuple(sorted({eos, eot})), filler_id=eos,
                       max_length=256, head_size=head_size, qk_norm=True, causal_prefix=True,
                       canvas_length=canvas_length, moe=moe, tied_head=True, sliding_window=256,
                       full_layers=(size["layers"] - 1,), full_head_size=head_size, full_kv_heads=size["kv_heads"])


def start_attention_scaled(model) -> None:
    """Set DiffusionGemma's per-head q/k norm weights to head_size^-1/4, so that its unscaled attention (scale 1)
    starts as scaled dot-product attention, q.k / sqrt(head_size): with weights 1, the logits of random unit-RMS
    queries and keys have a standard deviation of sqrt(head_size) and the softmax starts saturated. The first run
    (weights 1) matched the answers' layout by step 600 but copied no prompt character (RESULTS.md)."""
    with torch.no_grad():
        for layer in model.layers:
            for norm in (layer.q_norm, layer.k_norm):
                norm.weight.fill_(norm.weight.shape[0] ** -0.25)


def prompt_ids(tok, prompt: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def encode(tok, arch: str, examples, answer_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids [N, P], their lengths [N], answer ids [N, answer_length] (answer, end of turn,
    end-of-text padding)."""
    eos, eot = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids(END_OF_TURN[arch])
    prompts = [prompt_ids(tok, ex.prompt) for ex in examples]
    width = max(map(len, prompts))
    p = torch.full((len(prompts), width), eos, dtype=torch.long)
    a = torch.full((len(prompts), answer_length), eos, dtype=torch.long)
    for i, (ids, ex) in enumerate(zip(prompts, examples)):
        p[i, width - len(ids):] = torch.tensor(ids)
        ans = tok(ex.answer, add_special_tokens=False)["input_ids"] + [eot]
        if len(ans) > answer_length:
            raise ValueError(f"answer of {len(ans)} tokens does not fit --answer-length {answer_length}")
        a[i, :len(ans)] = torch.tensor(ans)
    return p, torch.tensor([len(x) for x in prompts]), a


def parse_mix(text: str) -> dict[str, float]:
    """``"copy:1,sort:2"`` -> sampling weight per family (families left out get 0); the list families
    (ParallelBench's operations on letters) only where named."""
    mix = {}
    for part in text.split(","):
        family, _, weight = part.partition(":")
        bad = ValueError(f"bad --mix entry {part!r}; write family:weight with a family of "
                         f"{', '.join(FAMILIES + LIST_FAMILIES)} and a weight >= 0")
        try:
            mix[family] = float(weight)
        except ValueError:
            raise bad from None
        if family not in FAMILIES + LIST_FAMILIES or not mix[family] >= 0:
            raise bad
    if not sum(mix.values()) > 0:
        raise ValueError(f"--mix {text!r} gives every family weight 0; give at least one a positive weight")
    return mix


def masked_diffusion_loss(model, prompts, lengths, answers, generator, eps: float = 1e-3) -> torch.Tensor:
    batch, width = prompts.shape
    width = int(lengths.max())
    prompts = prompts[:, -width:]
    real = torch.arange(width)[None] >= (width - lengths)[:, None]
    t = eps + (1 - eps) * torch.rand(batch, generator=generator)
    masked = torch.rand(answers.shape, generator=generator) < t[:, None]
    noisy = torch.where(masked, model.config.mask_id, answers)
    tokens = torch.cat((prompts, noisy), 1).to(model.device)
    real = torch.cat((real, torch.ones_like(answers, dtype=torch.bool)), 1).to(model.device)
    positions = (real.long().cumsum(1) - 1).clamp(min=0)
    rows = (torch.arange(width, tokens.shape[1]) - model.config.logit_shift).expand(batch, -1).to(model.device)
    logits = model.run(tokens, positions, real[:, None, None, :], logit_rows=rows)
    ce = F.cross_entropy(logits.float().flatten(0, 1), answers.to(model.device).flatten(), reduction="none")
    weight = (masked / t[:, None]).to(model.device).flatten()
    return (ce * weight).sum() / answers.numel()


def uniform_noise_inputs(model, prompts, lengths, answers, generator, eps: float = 1e-3) -> dict:
    """One forward's inputs for the uniform-noise loss of a uniform-state model (DiffusionGemma): the canvas
    `answers` `[B, C]` (answer, end of turn, end-of-text padding) with each token replaced by a uniformly random id
    with probability t ~ U(eps, 1) per row (the noise `entropy_bound` starts a canvas from and renoises with),
    after the left-padded prompt. In [prompt ; canvas] the prompt rows encode (causal) and the canvas rows decode
    (bidirectional over the prompt and the canvas), as the engine runs a canvas over its cached prompt.

    Returns tokens, positions `[B, N]`, key_mask (`visible_keys`) and logit_rows `[B, C]` (the canvas columns)."""
    batch, canvas = answers.shape
    width = int(lengths.max())
    t = eps + (1 - eps) * torch.rand(batch, 1, generator=generator)
    noise = torch.randint(0, model.config.vocab_size, answers.shape, generator=generator)
    noisy = torch.where(torch.rand(answers.shape, generator=generator) < t, noise, answers)
    device = model.device
    real = torch.cat((torch.arange(width)[None] >= (width - lengths)[:, None],
                      torch.ones_like(answers, dtype=torch.bool)), 1).to(device)
    positions = (real.long().cumsum(1) - 1).clamp(min=0)
    first = lengths.to(device)  # the canvas's first position
    return dict(tokens=torch.cat((prompts[:, -width:], noisy), 1).to(device), positions=positions,
                key_mask=model.visible_keys(positions, positions, real, window=(first, first + canvas)),
                logit_rows=torch.arange(width, width + canvas, device=device).expand(batch, -1))


def uniform_noise_loss(model, prompts, lengths, answers, generator, self_condition: bool) -> torch.Tensor:
    """Mean CE over the canvas of `uniform_noise_inputs`' forward (every position: the model is not told which
    tokens are noise). `self_condition`: first a no-grad pass on the same canvas, whose logits, scaled by a
    temperature drawn from entropy_bound's range [0.4, 0.8], condition the trained pass (the previous step's
    scaled logits at decoding)."""
    x = uniform_noise_inputs(model, prompts, lengths, answers, generator)
    conditioning = None
    if self_condition:
        scale = 0.4 + 0.4 * torch.rand(len(answers), 1, 1, generator=generator)
        with torch.no_grad():
            conditioning = model.run(**x) / scale.to(model.device)
    logits = model.run(**x, self_conditioning=conditioning)
    return F.cross_entropy(logits.float().flatten(0, 1), answers.to(model.device).flatten())


def block_diffusion_mask(blocks: torch.Tensor, noisy: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Which keys each query sees in the doubled sequence of `block_diffusion_inputs`, bool `[B, 1, N, N]`.

    blocks `[B, N]`: attention block of every column (RoPE position // block size); noisy `[N]`: the column
    belongs to the noisy copy; real `[B, N]`: not padding. A noisy query of block b sees the noisy keys of
    block b and the clean keys of blocks < b; a clean query of block b sees the clean keys of blocks <= b (the
    plain block-causal mask); no query sees a padding key. Every query also sees itself, so that a padding
    query has a key (its output is never used)."""
    qb, kb = blocks[:, :, None], blocks[:, None, :]
    qn, kn = noisy[None, :, None], noisy[None, None, :]
    see = torch.where(qn, torch.where(kn, kb == qb, kb < qb), ~kn & (kb <= qb)) & real[:, None, :]
    see |= torch.eye(blocks.shape[1], dtype=torch.bool, device=blocks.device)
    return see[:, None]


def left_padded(prompts, lengths, answers) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The left-padded prompts cut to the longest one `[B, P]`, and of [prompt | answer] which columns are real (not
    padding) and their RoPE positions, counted from each row's first prompt token, `[B, P + A]`."""
    width = int(lengths.max())
    real = torch.cat((torch.arange(width)[None] >= (width - lengths)[:, None],
                      torch.ones_like(answers, dtype=torch.bool)), 1)
    return prompts[:, -width:], real, (real.long().cumsum(1) - 1).clamp(min=0)


def block_diffusion_inputs(cfg: ModelConfig, prompts, lengths, answers, generator, eps: float = 1e-3) -> dict:
    """One forward's inputs for the block-diffusion loss (BD3-LM / SDAR training), laid out as the engine
    decodes a block-causal model: every row's RoPE positions count from its first prompt token, the answer
    follows the prompt, and the attention block the prompt ends in holds the prompt tail and the first answer
    tokens.

    x0 = [prompt | answer] (left padding as in `masked_diffusion_loss`); xt = x0 with each answer token
    masked with probability t, one t ~ U(eps, 1) per attention block of each row. The forward sees
    [xt ; x0] with positions [p ; p] under `block_diffusion_mask`, so the noisy copy of block b is predicted
    from itself and the clean blocks < b, as when the engine decodes block b. The noisy copy starts
    `block_size - 1` columns before the answer: every row's answer blocks and the prompt tail inside the
    first one, nothing a noisy answer query sees is left out.

    Returns tokens, positions `[B, N]`, key_mask `[B, 1, N, N]`, logit_rows `[B, A]` (the noisy answer
    columns), masked `[B, A]` and t `[B, A]` (the noise level of each answer token's block)."""
    if cfg.logit_shift:
        raise ValueError("the block-diffusion loss needs position-aligned logits (logit_shift 0)")
    batch = prompts.shape[0]
    size = cfg.block_size
    prompts, real, positions = left_padded(prompts, lengths, answers)
    width = prompts.shape[1]
    blocks = positions // size
    t_block = eps + (1 - eps) * torch.rand(batch, int(blocks.max()) + 1, generator=generator)
    t = t_block.gather(1, blocks[:, width:])
    masked = torch.rand(answers.shape, generator=generator) < t
    noisy = torch.where(masked, cfg.mask_id, answers)
    tail = max(width - (size - 1), 0)
    tokens = torch.cat((prompts[:, tail:], noisy, prompts, answers), 1)
    positions = torch.cat((positions[:, tail:], positions), 1)
    real = torch.cat((real[:, tail:], real), 1)
    is_noisy = torch.arange(tokens.shape[1]) < width - tail + answers.shape[1]  # the noisy copy's columns
    key_mask = block_diffusion_mask(positions // size, is_noisy, real)
    rows = (torch.arange(answers.shape[1]) + width - tail).expand(batch, -1)
    return dict(tokens=tokens, positions=positions, key_mask=key_mask, logit_rows=rows, masked=masked, t=t)


def block_diffusion_loss(model, prompts, lengths, answers, generator, eps: float = 1e-3,
                         denominator: int | None = None) -> torch.Tensor:
    """CE of the masked answer tokens of the noisy copy, each weighted 1/t of its block, divided by the
    number of answer tokens (the normalisation of `masked_diffusion_loss`; `denominator` when the batch is
    split, see `chunked_block_diffusion_loss`)."""
    x = block_diffusion_inputs(model.config, prompts, lengths, answers, generator, eps)
    device = model.device
    logits = model.run(x["tokens"].to(device), x["positions"].to(device), x["key_mask"].to(device),
                       logit_rows=x["logit_rows"].to(device))
    ce = F.cross_entropy(logits.float().flatten(0, 1), answers.to(device).flatten(), reduction="none")
    weight = (x["masked"] / x["t"]).to(device).flatten()
    return (ce * weight).sum() / (denominator or answers.numel())


def length_groups(need: torch.Tensor, chunks: int) -> list[torch.Tensor]:
    """The rows of a batch in at most `chunks` groups of similar `need` `[B]` (the canvas each row needs)."""
    order = need.argsort(stable=True)
    return [g for g in order.tensor_split(min(chunks, len(order))) if len(g)]


def chunked_block_diffusion_loss(model, prompts, lengths, answers, generator, chunks: int = 4,
                                 eps: float = 1e-3) -> torch.Tensor:
    """`block_diffusion_loss` of a batch run as `chunks` forwards of rows of similar answer length, each
    canvas cut after its longest answer's last attention block: a block-causal model decodes an answer to the
    end of the block holding its end of turn and stops there, so nothing after that block needs training,
    and short answers no longer pay for the longest one (about a third fewer tokens on the default mix).
    Divided by the answer tokens fed (answer, end of turn, end-of-text padding to each chunk's width)."""
    size = model.config.block_size
    need = (answers != model.config.filler_id).sum(1)  # answer and end of turn
    need = ((lengths + need + size - 1) // size * size - lengths).clamp(max=answers.shape[1])
    groups = length_groups(need, chunks)
    widths = [int(need[g].max()) for g in groups]
    total = sum(len(g) * w for g, w in zip(groups, widths))
    return sum(block_diffusion_loss(model, prompts[g], lengths[g], answers[g, :w], generator, eps, total)
               for g, w in zip(groups, widths))


def wedlm_mask(blocks: torch.Tensor, noisy: torch.Tensor, order: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Which keys each query sees in the sequence [xt ; x0] of `wedlm_inputs`, bool `[B, 1, N, N]` (the authors'
    `build_2d_attention_mask`, spec `wedlm.md` section 4).

    blocks `[B, N]`: training block of every column (RoPE position // block size); noisy `[N]`: the column belongs
    to the noisy copy; order `[B, N]`: a column's place in its copy (the clean copy: its position; the noisy copy:
    its index in the reordered sequence); real `[B, N]`: not padding. A clean query sees the clean keys at or before
    its position (plain causal); a noisy query of block b sees the clean keys of blocks < b and the noisy keys of
    block b at or before it in the reordered order. No query sees a padding key; every query sees itself."""
    qb, kb = blocks[:, :, None], blocks[:, None, :]
    before = order[:, None, :] <= order[:, :, None]
    qn, kn = noisy[None, :, None], noisy[None, None, :]
    see = torch.where(qn, torch.where(kn, (kb == qb) & before, kb < qb), ~kn & before) & real[:, None, :]
    see |= torch.eye(blocks.shape[1], dtype=torch.bool, device=blocks.device)
    return see[:, None]


def wedlm_inputs(cfg: ModelConfig, prompts, lengths, answers, generator, block_size: int) -> dict:
    """One forward's inputs for WeDLM's dual-stream loss (Tencent/WeDLM `finetune/src/batch.py`, `masking.py`; spec
    `wedlm.md` section 4), with left padding and RoPE positions counted from each row's first prompt token.

    Blocks of `block_size` positions start at a random offset per row (`shift`, uniform in [0, block_size)). The
    authors align blocks at each sample's start; over their varied prompts a block boundary lands at every answer
    position, but a synthetic family's prompts have a few lengths, so with aligned blocks the boundary before a given
    answer position sat at the same few places. Decoding's window starts at any committed front. For example, the
    reverse of 12 characters always had a boundary at answer index 6. So the window's first step (16 masks from the
    answer start) was never trained for it, and the first tiny-wedlm got 0 of 19 such answers right at tau 0.4.

    x0 = [prompt | answer]; xt: in each block, gamma ~ U(0, 1) (at least 1e-8) and round(n * gamma) of its n answer
    tokens chosen uniformly are masked (the prompt never is), then the block is reordered, unmasked tokens in
    position order first, then the masks, each keeping its position. The forward sees [xt ; x0] under `wedlm_mask`,
    so each noisy block is computed as a decoding step computes its window after a committed prefix. The noisy copy
    starts `block_size - 1` columns before the answer (the prompt tail that shares the first answer block).

    Returns tokens, positions `[B, N]`, key_mask `[B, 1, N, N]`, logit_rows `[B, 2A]` (each answer token's noisy
    row, then the clean row before each answer token: the AR loss's), masked `[B, A]`, gamma `[B, A]` (its
    block's) and shift `[B, 1]` (a position's block is (position + shift) // block_size)."""
    if cfg.logit_shift:
        raise ValueError("WeDLM's loss needs position-aligned logits (logit_shift 0)")
    batch, n_answer = answers.shape
    prompts, real, positions = left_padded(prompts, lengths, answers)
    width = prompts.shape[1]
    shift = torch.randint(block_size, (batch, 1), generator=generator)
    blocks = (positions + shift) // block_size
    gamma = torch.rand(batch, int(blocks.max()) + 1, generator=generator).clamp(min=1e-8).gather(1, blocks[:, width:])
    same = blocks[:, width:, None] == blocks[:, None, width:]  # answer tokens of one block
    draw = torch.rand(answers.shape, generator=generator)
    below = (same & (draw[:, None, :] < draw[:, :, None])).sum(2)  # the block's tokens drawn before this one
    masked = below < torch.round(same.sum(2) * gamma)
    tail = max(width - (block_size - 1), 0)
    segment = torch.cat((prompts[:, tail:], torch.where(masked, cfg.mask_id, answers)), 1)
    seg_masked = torch.cat((torch.zeros(batch, width - tail, dtype=torch.bool), masked), 1)
    reorder = (blocks[:, tail:] * 2 + seg_masked).sort(dim=1, stable=True).indices  # within a block: unmasked first
    n_noisy = segment.shape[1]
    tokens = torch.cat((segment.gather(1, reorder), prompts, answers), 1)
    positions = torch.cat((positions[:, tail:].gather(1, reorder), positions), 1)
    key_mask = wedlm_mask((positions + shift) // block_size, torch.arange(tokens.shape[1]) < n_noisy,
                          torch.cat((torch.arange(n_noisy).expand(batch, -1), positions[:, n_noisy:]), 1),
                          torch.cat((real[:, tail:].gather(1, reorder), real), 1))
    noisy_rows = reorder.argsort(1)[:, width - tail:]  # where each answer token's noisy copy went
    clean_rows = n_noisy + width - 1 + torch.arange(n_answer).expand(batch, -1)
    return dict(tokens=tokens, positions=positions, key_mask=key_mask,
                logit_rows=torch.cat((noisy_rows, clean_rows), 1), masked=masked, gamma=gamma, shift=shift)


def wedlm_loss(model, prompts, lengths, answers, generator, block_size: int, ar_weight: float = 1.0,
               chunks: int = 1) -> torch.Tensor:
    """(L_mlm + ar_weight L_ar) / (1 + ar_weight), the authors' default weight 1: L_mlm the CE of each masked token
    at its own noisy row, a mean weighted 1/gamma of its block; L_ar the mean next-token CE of the clean answer.

    The batch runs as `chunks` forwards of rows of similar answer length (`length_groups`), each canvas cut
    `block_size - 1` positions after its longest answer's end of turn (a window no wider than the training block
    never reaches further before the end of turn is committed); the means are the whole batch's."""
    device = model.device
    need = ((answers != model.config.filler_id).sum(1) + block_size - 1).clamp(max=answers.shape[1])
    weighted, weights, ar, ar_count = 0.0, 0.0, 0.0, 0
    for g in length_groups(need, chunks):
        part = answers[g, :int(need[g].max())]
        x = wedlm_inputs(model.config, prompts[g], lengths[g], part, generator, block_size)
        logits = model.run(x["tokens"].to(device), x["positions"].to(device), x["key_mask"].to(device),
                           logit_rows=x["logit_rows"].to(device))
        n = part.shape[1]
        ce = F.cross_entropy(logits.float().flatten(0, 1), part.repeat(1, 2).to(device).flatten(),
                             reduction="none").view(len(g), 2 * n)
        weight = (x["masked"] / x["gamma"]).to(device)
        weighted, weights = weighted + (ce[:, :n] * weight).sum(), weights + weight.sum()
        ar, ar_count = ar + ce[:, n:].sum(), ar_count + ce[:, n:].numel()
    mlm = weighted / max(float(weights), 1.0)  # 0 when no token is masked
    return (mlm + ar_weight * ar / ar_count) / (1 + ar_weight)


@torch.no_grad()
def evaluate(model, tok, examples, answer_length: int, block_length: int, sampler: str = "low_confidence"
             ) -> dict[str, float]:
    """Exact match per family with vanilla decoding (low_confidence, one token per step, T = 0), or `sampler`.
    A block-causal model (SDAR) decodes in its attention blocks with its exact block cache, its answers starting
    at each row's prompt end (not at one canvas column), so they are read through `generate`. A uniform-state
    model (DiffusionGemma) decodes as its family does (entropy_bound, the canvases its generation defaults name). A
    causal model (WeDLM) decodes blocks of one position: each token from a mask row after the committed answer, its
    streaming decoding with a window of 1 (the window layout is not in the loop yet)."""
    model.eval()
    ids = [prompt_ids(tok, ex.prompt) for ex in examples]
    if model.config.mask_id is None:
        texts = generate(model, tok, ids).texts
    elif model.config.causal:
        texts = generate(model, tok, ids, sampler=sampler, gen_length=answer_length, block_length=1).texts
    elif model.config.block_size:
        texts = generate(model, tok, ids, sampler=sampler, gen_length=answer_length,
                         block_length=model.config.block_size).texts
    else:
        canvas, _, _ = decode(model, ids, samplers_mod.SAMPLERS.create(sampler), caches.CACHES.create("none"),
                              answer_length, block_length)
        texts = [tok.decode(row, skip_special_tokens=True) for row in canvas.tokens[:, canvas.prompt_length:].tolist()]
    model.train()
    hits: dict[str, list[bool]] = {ex.family: [] for ex in examples}
    for ex, text in zip(examples, texts):
        hits[ex.family].append(score(ex, text))
    acc = {f: sum(h) / len(h) for f, h in hits.items() if h}
    acc["mean"] = sum(acc.values()) / len(acc)
    return acc


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def save_state(state_dir: Path, model, optimizer, step: int) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    save_model(model, str(state_dir / "model.safetensors"))  # a tied head (DiffusionGemma) stored once
    moments = {}
    for i, p in enumerate(optimizer.param_groups[0]["params"]):
        for key, value in optimizer.state.get(p, {}).items():
            moments[f"{i}.{key}"] = value.reshape(1) if value.dim() == 0 else value
    save_file(moments, str(state_dir / "optimizer.safetensors"))
    (state_dir / "state.json").write_text(json.dumps({"step": step}))


def start_from(model, checkpoint: str) -> None:
    """Copy a trained checkpoint's weights into `model` (`--init`): a model that already copies characters learns
    new operations on them in far fewer steps than one from random weights."""
    trained, _ = dllm.load(checkpoint, threads=torch.get_num_threads())  # keeps --threads
    if trained.config != model.config:
        diff = sorted(k for k, v in vars(model.config).items() if getattr(trained.config, k, None) != v)
        raise ValueError(f"--init {checkpoint} is another model (config differs in {', '.join(diff[:3])}); "
                         "train with its size and character set, or drop --init")
    model.load_state_dict(trained.state_dict())


def load_state(state_dir: Path, model, optimizer) -> int:
    if not (state_dir / "state.json").exists():
        return 0
    try:
        load_model(model, str(state_dir / "model.safetensors"))
    except RuntimeError as err:  # a run of another size, tokenizer or architecture
        first = str(err).splitlines()[-1].strip().rstrip(".")
        raise ValueError(f"{state_dir} holds a run of a different model ({first}); "
                         f"pass another --state or delete that directory") from None
    moments = load_file(str(state_dir / "optimizer.safetensors"))
    params = optimizer.param_groups[0]["params"]
    for name, value in moments.items():
        i, key = name.split(".", 1)
        optimizer.state[params[int(i)]][key] = value.reshape(()) if key == "step" else value
    return json.loads((state_dir / "state.json").read_text())["step"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=("llada", "dream", "sdar", "dgemma", "wedlm"), required=True)
    ap.add_argument("--out", required=True, help="output Hugging Face directory")
    ap.add_argument("--state", default=None, help="run state directory for resuming (default runs/train-ARCH)")
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=None, help="default: heads (LLaDA), heads/2 (Dream, SDAR)")
    ap.add_argument("--ff", type=int, default=None, help="default: 3 * d")
    ap.add_argument("--answer-length", type=int, default=64, help="longest answer canvas (with padding)")
    ap.add_argument("--min-answer-length", type=int, default=48, help="shortest answer canvas of a batch")
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--mix", default="copy:1,reverse:1,sort:2,count:1.5,add:2",
                    help="sampling weight per family")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast for the forward and backward")
    ap.add_argument("--block-size", type=int, default=None,
                    help="SDAR: its attention block (RoPE positions), default 4 as the released SDAR chat models; "
                         "WeDLM: its training block, default 16 (at least the window it decodes with)")
    ap.add_argument("--canvas-length", type=int, default=48,
                    help="DiffusionGemma: the canvas, one per answer (the longest answer and its end of turn fit 47)")
    ap.add_argument("--self-conditioning", type=float, default=0.5,
                    help="DiffusionGemma: the share of steps that condition on a first no-grad pass")
    ap.add_argument("--chunks", type=int, default=4,
                    help="SDAR, WeDLM: forwards per batch, rows grouped by answer length (less padding)")
    ap.add_argument("--block-length", type=int, default=None,
                    help="blocks used by the periodic evaluation (default 32; SDAR: its --block-size)")
    ap.add_argument("--train-per-family", type=int, default=100_000)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--eval-per-family", type=int, default=20)
    ap.add_argument("--save-every", type=int, default=250)
    ap.add_argument("--seed", type=int, default=0,
                    help="initialisation and batch order; the data is always split 0, the one `dllm eval` tests on")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--init", default=None,
                    help="start from this checkpoint's weights (a shipped name or a directory; same architecture, "
                         "size and character set), not from random ones")
    args = ap.parse_args(argv)
    args.block_size = args.block_size or (16 if args.arch == "wedlm" else 4)
    for flag in ("block_size", "batch_size", "steps", "eval_every", "save_every"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    state_dir = Path(args.state or f"runs/train-{args.arch}")

    tok = build_tokenizer(TOKENIZER_STYLE[args.arch], CHARSET)
    size = dict(d=args.d, layers=args.layers, heads=args.heads, ff=args.ff or 3 * args.d,
                kv_heads=args.kv_heads or (args.heads if args.arch == "llada" else max(args.heads // 2, 1)))
    config = dgemma_config(tok, size, args.rope_theta, args.canvas_length) if args.arch == "dgemma" else \
        model_config(args.arch, tok, size, args.rope_theta, args.block_size)
    model = build_model(config, args.device, torch.float32)
    init_random(model, args.seed)
    if args.arch == "dgemma":
        start_attention_scaled(model)
    if args.init:
        start_from(model, args.init)
    mix = parse_mix(args.mix)
    # trained on single turns (`dllm chat` starts each afresh) of these prompts (others get a notice); a uniform-state
    # model decodes one canvas per answer
    lists = [f for f in LIST_FAMILIES if mix.get(f, 0) > 0]  # after the suite's examples, which stay as they were
    written = {"multi_turn": False, **training_format([f for f in FAMILIES + LIST_FAMILIES if mix.get(f, 0) > 0]),
               **(dict(max_new_tokens=args.canvas_length, block_length=args.canvas_length) if args.arch == "dgemma"
                  else {})}  # generation_config.json, read as the loader reads it
    model.generation_defaults = read_generation_config(written, ARCHITECTURES_BY_NAME[config.arch],
                                                       out / "generation_config.json")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    start = load_state(state_dir, model, optimizer)

    train = make_split("train", args.train_per_family) + make_split("train", args.train_per_family, families=lists)
    prompts, lengths, answers = encode(tok, args.arch, train, args.answer_length)
    held_out = [ex for f in FAMILIES + tuple(lists) for ex in make_split("test", args.eval_per_family, families=[f])]
    print(f"{args.arch}: {model.config.num_parameters() / 1e6:.2f}M parameters, {len(train)} training examples, "
          f"resuming at step {start}" if start else
          f"{args.arch}: {model.config.num_parameters() / 1e6:.2f}M parameters, {len(train)} training examples")

    weights = torch.tensor([mix.get(ex.family, 0.0) for ex in train], dtype=torch.double)
    longest = int((answers != tok.eos_token_id).sum(1).max())  # answer tokens and end of turn, without padding
    if not longest <= args.min_answer_length <= args.answer_length:
        raise ValueError(f"--min-answer-length must be in [{longest}, --answer-length], got {args.min_answer_length}")
    if args.arch == "dgemma" and not longest <= args.canvas_length <= args.answer_length:
        raise ValueError(f"--canvas-length must be in [{longest}, --answer-length], got {args.canvas_length}")

    block_length = args.block_length or (args.block_size if args.arch == "sdar" else 32)
    began = time.time()
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc=f"train {args.arch}")
    for step in bar:
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)  # batch depends only on (seed, step)
        idx = torch.multinomial(weights, args.batch_size, replacement=True, generator=g)
        # Like LLaDA's SFT batches, the end-of-text padding has a varying length, so every position up to
        # --answer-length learns to stay padding.
        width = int(torch.randint(args.min_answer_length, args.answer_length + 1, (), generator=g))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        with torch.autocast(model.device.type, torch.bfloat16, enabled=args.bf16):
            if args.arch == "sdar":  # block diffusion, the canvas cut per chunk (`chunked_block_diffusion_loss`)
                loss = chunked_block_diffusion_loss(model, prompts[idx], lengths[idx], answers[idx], g, args.chunks)
            elif args.arch == "wedlm":
                loss = wedlm_loss(model, prompts[idx], lengths[idx], answers[idx, :width], g, args.block_size,
                                  chunks=args.chunks)
            elif args.arch == "dgemma":  # the whole canvas: a uniform-state model decodes all of it
                self_condition = bool(torch.rand((), generator=g) < args.self_conditioning)
                loss = uniform_noise_loss(model, prompts[idx], lengths[idx], answers[idx, :args.canvas_length], g,
                                          self_condition)
            else:
                loss = masked_diffusion_loss(model, prompts[idx], lengths[idx], answers[idx, :width], g)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{optimizer.param_groups[0]['lr']:.2e}")
        done = step + 1
        if done % args.save_every == 0 or done == args.steps:
            save_state(state_dir, model, optimizer, done)
        if done % args.eval_every == 0 or done == args.steps:
            acc = evaluate(model, tok, held_out, args.answer_length, block_length)
            tqdm.write(f"step {done} ({(time.time() - began) / 60:.1f} min): "
                       + " ".join(f"{k} {v:.2f}" for k, v in acc.items()))
            if args.arch == "sdar":  # also SDAR's own decoding (threshold 0.85, at least one token a step)
                acc = evaluate(model, tok, held_out, args.answer_length, block_length, "low_confidence_dynamic")
                tqdm.write("  low_confidence_dynamic: " + " ".join(f"{k} {v:.2f}" for k, v in acc.items()))
    model.eval()
    save_pretrained(model, tok, out)
    print(f"saved {out} after {(time.time() - began) / 60:.1f} min")


if __name__ == "__main__":
    try:
        main()
    except ValueError as err:
        sys.exit(f"error: {err}")
