"""The Gemma 4 network of DiffusionGemma (spec `new_families.md` section 1; transformers' `diffusion_gemma`), one
weight set run in two modes:

- encoder: causal over the prompt or a committed canvas; its keys and values go to the cache (`KVAccess.update`);
- decoder: the canvas attends bidirectionally to `[committed keys ; canvas]` (in sliding layers only the last
  `sliding_window - 1` committed keys), from inputs mixed with the previous step's prediction (self-conditioning).

The mode is a row's own (`Masks.decoder`), so one forward can encode a finished canvas and decode the next (the
decode loop's block-start forward): encoder rows see only earlier keys, so they never read the decoder's.

Layers are sliding (local RoPE, own V) or full (proportional RoPE on the first `full_rope_fraction` of frequency
pairs, fewer and wider K/V heads, V = the raw K projection); q/k are RMS-normalised per head, v without a weight;
attention is unscaled (scale 1). Every layer runs a dense GeGLU and a mixture of experts side by side (`moe.py`,
Gemma's router), with sandwich norms and a learned per-layer scalar, one for each mode. Norms are `x * w`, not
Gemma 2/3's `x * (1 + w)`. Logits are soft-capped: `cap * tanh(logits / cap)`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .moe import GatedMLP, MoE
from .sharding import expected_embedding
from .transformer import KVAccess, ModelConfig, Network, Rows, head, rope, rope_frequencies, rope_tables


@dataclass(frozen=True)
class GemmaConfig(ModelConfig):
    """`ModelConfig`'s fields describe the sliding layers (`rope_theta`, `n_kv_heads`, `head_size`). The attention
    is causal-prefix (`causal_prefix`): committed tokens causal, the canvas being denoised bidirectional over them
    and itself, in canvases of `canvas_length`."""

    canvas_length: int = 256  # the block the model was trained to denoise
    sliding_window: int = 512  # a sliding layer's causal query sees this many keys, itself included
    full_layers: tuple[int, ...] = ()  # the full-attention layers
    full_head_size: int = 512
    full_kv_heads: int = 2
    full_rope_theta: float = 1_000_000.0
    full_rope_fraction: float = 0.25  # proportional RoPE: the first fraction of the frequency pairs rotate
    logit_softcap: float = 30.0
    image_token_id: int | None = None  # a prompt holding it asks for the vision tower, which is not loaded

    def __post_init__(self):
        super().__post_init__()
        if self.moe is None or self.moe.router != "gemma":
            raise ValueError("DiffusionGemma needs a mixture of experts with Gemma's router in every layer")
        if not self.full_layers or any(not 0 <= i < self.n_layers for i in self.full_layers):
            raise ValueError(f"full-attention layers {self.full_layers} must be among the {self.n_layers} layers")
        if self.canvas_length < 1 or isinstance(self.canvas_length, bool):
            raise ValueError(f"canvas_length must be a positive integer, got {self.canvas_length!r}")
        if self.n_heads % self.full_kv_heads or self.full_head_size % 2 or self.sliding_window < 2:
            raise ValueError(f"{self.full_kv_heads} full-layer key/value heads must divide {self.n_heads} heads, "
                             f"the full head size {self.full_head_size} be even and the window at least 2")

    def kv_shape(self, layer: int) -> tuple[int, int]:
        """Key/value heads and head size of `layer`."""
        if layer in self.full_layers:
            return self.full_kv_heads, self.full_head_size
        return self.n_kv_heads, self.head_dim

    def num_parameters(self) -> int:
        d, f, heads = self.hidden_size, self.intermediate_size, self.n_heads
        total = self.vocab_size * d * (1 if self.tied_head else 2) + d + d + 3 * d * f  # + self-conditioning
        for layer in range(self.n_layers):
            kv_heads, size = self.kv_shape(layer)
            own_v = layer not in self.full_layers
            total += d * size * (2 * heads + kv_heads * (1 + own_v)) + 2 * size  # q, o, k (, v); q/k norms
            total += 7 * d + 3 * d * f + self.moe.layer_parameters(d) + 2  # norms, dense GeGLU, MoE, scalars
        return total


def full_rope_frequencies(cfg: GemmaConfig, device=None) -> Tensor:
    """Proportional RoPE: `theta^(-2j / D)` for the first `fraction * D / 2` pairs j of the D-wide head, zero
    (no rotation) for the rest, in the rotate-half layout over the whole head."""
    size, angles = cfg.full_head_size, int(cfg.full_rope_fraction * cfg.full_head_size // 2)
    exponent = torch.arange(0, 2 * angles, 2, dtype=torch.float64, device=device) / size
    rotated = (cfg.full_rope_theta ** -exponent).float()
    return torch.cat((rotated, rotated.new_zeros(size // 2 - angles)))


class Norm(nn.Module):
    """RMSNorm computed in fp32 with the weight (`x * rsqrt(mean(x^2) + eps) * w`), cast back; no weight when
    `weighted` is False (V and the self-conditioning output)."""

    def __init__(self, dim: int, eps: float, weighted: bool = True):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim)) if weighted else None

    def forward(self, x: Tensor) -> Tensor:
        weight = None if self.weight is None else self.weight.float()
        return F.rms_norm(x.float(), (self.dim,), weight, self.eps).to(x.dtype)


class GemmaBlock(nn.Module):
    """One layer: sliding or full attention, then the dense GeGLU and the experts side by side on the residual
    stream, every output normed before it is added (sandwich norms), the sum times the mode's layer scalar."""

    def __init__(self, cfg: GemmaConfig, layer: int):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.n_heads, (self.n_kv_heads, self.head_dim) = cfg.n_heads, cfg.kv_shape(layer)
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=False)
        if layer not in cfg.full_layers:  # full layers take V from the raw K projection
            self.v_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=False)
        self.q_norm, self.k_norm = Norm(self.head_dim, eps), Norm(self.head_dim, eps)
        self.v_norm = Norm(self.head_dim, eps, weighted=False)
        self.attn_norm, self.attn_out_norm = Norm(d, eps), Norm(d, eps)
        self.mlp_norm, self.mlp_out_norm = Norm(d, eps), Norm(d, eps)
        self.mlp = GatedMLP(d, cfg.intermediate_size, "gelu_tanh")
        self.moe_norm, self.moe_out_norm, self.moe = Norm(d, eps), Norm(d, eps), MoE(d, cfg.moe)
        self.ffn_out_norm = Norm(d, eps)
        self.encoder_scale = nn.Parameter(torch.ones(1), requires_grad=False)  # layer_scalar of each mode
        self.decoder_scale = nn.Parameter(torch.ones(1), requires_grad=False)

    def heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, key_mask: Tensor, kv: KVAccess | None, rows: Rows,
                layer: int, decoder: Tensor) -> Tensor:
        """`decoder` `[B, A, 1]` bool: the rows in decoder mode (their layer scalar is the decoder's)."""
        h = self.attn_norm(x)
        raw_k = self.heads(self.k_proj(h))
        q = rope(self.q_norm(self.heads(self.q_proj(h))), cos, sin)
        k = rope(self.k_norm(raw_k), cos, sin)
        v = self.v_norm(self.heads(self.v_proj(h)) if hasattr(self, "v_proj") else raw_k)
        if kv is not None:
            k, v = kv.update(layer, rows, q, k, v)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, scale=1.0,
                                           enable_gqa=self.n_heads != self.n_kv_heads)
        x = x + self.attn_out_norm(self.o_proj(o.transpose(1, 2).flatten(2)))
        dense = self.mlp_out_norm(self.mlp(self.mlp_norm(x)))
        routed = self.moe_out_norm(self.moe(self.moe_norm(x), router_input=x))
        return (x + self.ffn_out_norm(dense + routed)) * torch.where(decoder, self.decoder_scale, self.encoder_scale)


class SelfConditioning(nn.Module):
    """The decoder's input: `post_norm(embedding + GeGLU(pre_norm(soft)))`, soft = the expected embedding under
    softmax(previous step's scaled logits), zero at a canvas's first step (then the GeGLU adds exactly 0)."""

    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        self.norm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, "gelu_tanh")
        self.out_norm = Norm(cfg.hidden_size, cfg.rms_norm_eps, weighted=False)

    def forward(self, x: Tensor, soft: Tensor | None, index: Tensor | None = None) -> Tensor:
        """The decoder input of rows `x` `[B, A, D]`, `soft` `[B, C, D]` conditioning rows `index` `[B, C]` (None:
        every row)."""
        if soft is not None:
            added = self.mlp(self.norm(soft)).to(x.dtype)  # bf16 under autocast (training)
            x = x + added if index is None else x.scatter_add(1, index[..., None].expand_as(added), added)
        return self.out_norm(x)


class Masks(NamedTuple):
    """What each query of a forward sees (bool `[B, 1, A, Lk]`) in sliding and in full layers, and which queries
    decode (`[B, A]` bool: the canvas; the others encode)."""

    sliding: Tensor
    full: Tensor
    decoder: Tensor


class DiffusionGemma(Network):
    """DiffusionGemma's text network. `run` computes rows, each in its mode, against a cache's keys and values (the
    contract of `DiffusionLM.run`, with the per-layer-kind masks and modes of `visible_keys`)."""

    def __init__(self, cfg: GemmaConfig):
        super().__init__(cfg)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GemmaBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_conditioning = SelfConditioning(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("sliding_inv_freq", torch.empty(0), persistent=False)
        self.register_buffer("full_inv_freq", torch.empty(0), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        super().init_buffers()
        self.sliding_inv_freq = rope_frequencies(self.config, self.sliding_inv_freq.device)
        self.full_inv_freq = full_rope_frequencies(self.config, self.full_inv_freq.device)

    def kv_shapes(self) -> list[tuple[int, int]]:
        """Key/value heads (this rank's, tensor parallel) and head size of every layer (a cache's store is shaped by
        them)."""
        return [(layer.n_kv_heads, layer.head_dim) for layer in self.layers]

    def visible_keys(self, query_positions: Tensor, key_positions: Tensor, key_mask: Tensor | None,
                     window: tuple[Tensor, Tensor] | None = None) -> Masks:
        """`run`'s masks from RoPE positions (`[B, A]` queries, `[B, Lk]` keys), `key_mask` (real keys, broadcastable
        to `[B, 1, 1, Lk]`; None: all) and the canvas being decoded, `window` = (first, end) positions `[B]` (None:
        every query encodes). Encoder queries: causal, in sliding layers the last `sliding_window` keys (itself
        included). Decoder queries (inside the window): every key before the window's end, in sliding layers from
        `sliding_window - 1` before its start."""
        q, k = query_positions[:, None, :, None], key_positions[:, None, None, :]
        span = self.config.sliding_window
        full = k <= q
        sliding = full & (k > q - span)
        if window is None:
            decoder = torch.zeros_like(query_positions, dtype=torch.bool)
        else:
            first, end = (bound[:, None, None, None] for bound in window)
            inside = (q >= first) & (q < end)
            decoder = inside[:, 0, :, 0]
            full = full | (inside & (k < end))
            sliding = torch.where(inside, (k < end) & (k >= first - (span - 1)), sliding)
        if key_mask is not None:
            key_mask = key_mask.reshape(key_mask.shape[0], 1, 1, -1)
            full, sliding = full & key_mask, sliding & key_mask
        return Masks(sliding, full, decoder)

    def embed_scale(self) -> Tensor:
        """sqrt(hidden), rounded to the weights' type (53.0 in bf16 at 2816), as the embeddings are scaled."""
        return torch.tensor(self.config.hidden_size ** 0.5, dtype=self.dtype, device=self.device)

    def soft_embedding(self, logits: Tensor) -> Tensor:
        """The expected (scaled) embedding under softmax(logits) `[B, A, V]`: self-conditioning's input."""
        probs = logits.to(self.dtype).softmax(-1, dtype=torch.float32)  # rounded to the weights' type first, as
        # transformers' generate passes the logits on
        return expected_embedding(probs.to(self.dtype), self.embed) * self.embed_scale()

    def run(self, tokens: Tensor, positions: Tensor, key_mask: Masks, kv: KVAccess | None = None,
            rows: Rows | None = None, logit_rows: Tensor | None = None,
            self_conditioning: Tensor | None = None) -> Tensor:
        """Push rows through the network, each in its mode (`key_mask.decoder`).

        tokens, positions: `[B, A]` ids and RoPE positions. key_mask: `visible_keys`' masks over the keys the cache
        returns (or the rows themselves when kv is None). rows: which canvas rows they are (for the cache; None =
        all). logit_rows: `[B, C]` indices into the rows whose logits are wanted (None = all). self_conditioning:
        the previous step's scaled logits `[B, C, V]` of those rows, which decode (None: a canvas's first step).
        Returns soft-capped fp32 logits `[B, C, V]`."""
        rows = Rows(slice(0, tokens.shape[1])) if rows is None else rows
        decoder = key_mask.decoder[..., None]
        x = self.embed(tokens) * self.embed_scale()
        soft = None if self_conditioning is None else self.soft_embedding(self_conditioning)
        x = torch.where(decoder, self.self_conditioning(x, soft, logit_rows), x)
        sliding = rope_tables(positions, self.sliding_inv_freq)
        full = rope_tables(positions, self.full_inv_freq)
        for i, layer in enumerate(self.layers):
            if i in self.config.full_layers:
                x = layer(x, *full, key_mask.full, kv, rows, i, decoder)
            else:
                x = layer(x, *sliding, key_mask.sliding, kv, rows, i, decoder)
        if logit_rows is not None:
            x = x.gather(1, logit_rows[..., None].expand(-1, -1, x.shape[-1]))
        cap = self.config.logit_softcap
        return torch.tanh(head(self.norm(x), self.lm_head.weight).float() / cap) * cap
