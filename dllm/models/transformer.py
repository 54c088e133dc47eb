"""The pre-norm transformer shared by every architecture (LLaDA, Dream, SDAR, LLaDA2, LLaDA-MoE, Fast-dLLM v2,
Nemotron-Labs-Diffusion, WeDLM).

All are Llama-shaped (RMSNorm, rotate-half RoPE, SwiGLU, untied head), most run without a causal mask; they differ
in q/k/v bias, GQA, per-head q/k norm, partial RoPE, YaRN RoPE and a per-position query scale, MoE feed-forward
layers (`moe.py`), block-causal, causal-prefix or causal attention and Dream's AR-style logit shift (spec
`models.md` sections 3-4, `block_diffusion_moe.md`, `new_families.md`, `wedlm.md`). The
forward computes only the *active* canvas rows chosen by the cache policy, lets the cache supply keys and
values of every other row (`KVAccess`), and projects the head only on the rows whose logits are needed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .generation import GenerationConfig
from .moe import MoE, MoEConfig
from .quantize import is_quantized
from .rope_scaling import YaRN


@dataclass(frozen=True)
class ModelConfig:
    """Architecture and special ids of one network (read from `config.json` or a named preset)."""

    arch: str  # a module of `dllm.models.ARCHITECTURES_BY_NAME`
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    rms_norm_eps: float
    rope_theta: float
    qkv_bias: bool
    logit_shift: int  # 0: logits[i] predict token i (LLaDA); 1: hidden i-1 predicts token i (Dream)
    mask_id: int | None  # None: a uniform-state model, whose canvas starts as random tokens (DiffusionGemma)
    pad_id: int
    stop_ids: tuple[int, ...]  # a row's answer ends at the first of these
    filler_id: int  # written after the answer once a row has finished
    max_length: int  # longest canvas the model is meant for
    head_size: int = 0  # per-head width when it is not hidden_size / n_heads (Qwen3: 128)
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3, SDAR)
    block_size: int = 0  # > 0: block-causal attention, a position sees its own block and all earlier ones (SDAR)
    rotary_dim: int = 0  # RoPE on the first this many dims of each head (LLaDA2: 64 of 128); 0: all of them
    moe: MoEConfig | None = None  # feed-forward layers from `moe.dense_layers` on are mixtures of experts
    tied_head: bool = False  # the LM head is the embedding matrix (`tie_word_embeddings`, small Qwen3 / SDAR)
    edit_ids: tuple[int, int] | None = None  # (delete, split) tokens of insert/delete decoding (LLaDA2.2)
    yarn: YaRN | None = None  # YaRN-scaled RoPE frequencies (Ministral 3, Nemotron-Labs-Diffusion)
    query_scale: tuple[float, int] | None = None  # (beta, length): queries times 1 + beta * log(1 + floor(position /
    # length)) after RoPE (Llama 4's attention temperature, as Ministral 3)
    causal_prefix: bool = False  # decoded positions attend causally; the positions being decoded (a step's logit
    # window) see each other and everything before them (Nemotron-Labs-Diffusion: causal commit, bidirectional
    # denoising)
    causal: bool = False  # plain causal attention (WeDLM): a query sees the keys whose rank is at most its own, the
    # ranks `visible_keys` is given (positions; WeDLM's window ranks filled slots before masks, spec `wedlm.md` 1.4)

    def __post_init__(self):
        """Refuse values that would build a broken network (a config.json with a wrong, zero or null field)."""
        for name, low in [*((n, 1) for n in ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads",
                                               "max_length")),
                          *((n, 0) for n in ("intermediate_size", "head_size", "block_size", "rotary_dim"))]:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.n_heads % self.n_kv_heads or (not self.head_size and self.hidden_size % self.n_heads):
            raise ValueError(f"{self.n_heads} attention heads do not split hidden size {self.hidden_size} or "
                             f"{self.n_kv_heads} key/value heads evenly")
        if self.rope_dim % 2 or self.rope_dim > self.head_dim:
            raise ValueError(f"the rotary dims ({self.rope_dim}) must be even and at most the head dim {self.head_dim}")
        if self.query_scale is not None:
            beta, length = self.query_scale
            if not beta >= 0 or isinstance(length, bool) or not isinstance(length, int) or length < 1:
                raise ValueError(f"the query scale needs beta >= 0 and a positive length, got {self.query_scale!r}")
        if self.causal_prefix + bool(self.block_size) + self.causal > 1:
            raise ValueError("a network is one of block-causal (block_size), causal-prefix or causal, not several")
        # (stop ids are not checked: one outside the vocabulary never stops a row)
        ids = [] if self.mask_id is None else [("mask token id", self.mask_id)]
        for name, value in [*ids, ("pad token id", self.pad_id), ("eos token id", self.filler_id)]:
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.vocab_size:
                raise ValueError(f"the {name} {value!r} must be a token id below vocab_size {self.vocab_size}")

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.n_heads

    @property
    def placeholder_id(self) -> int:
        """What an answer position holds before its block is decoded: the mask, or on a uniform-state model (whose
        sampler draws each block's random canvas) the pad."""
        return self.pad_id if self.mask_id is None else self.mask_id

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def decoded_keys_fixed(self) -> bool:
        """A decoded block's keys and values stop changing once the next block starts (block-causal or
        causal-prefix or causal attention): the exact `block` cache applies, caches choosing rows for full attention
        do not."""
        return bool(self.block_size) or self.causal_prefix or self.causal

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer >= self.moe.dense_layers

    def num_parameters(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attn = 2 * d * q + 2 * d * kv + (q + 2 * kv if self.qkv_bias else 0)
        attn += 2 * self.head_dim if self.qk_norm else 0
        mlp = [self.moe.layer_parameters(d) if self.is_moe_layer(i) else 3 * d * f for i in range(self.n_layers)]
        return 2 * v * d + d + self.n_layers * (attn + 2 * d) + sum(mlp)


@dataclass(frozen=True)
class Rows:
    """The canvas rows one forward computes, given to the model and the cache explicitly: `index` is a slice,
    a `[A]` tensor of positions shared by every batch row (static shapes for `torch.compile`), or a `[B, A]`
    tensor whose `valid` `[B, A]` marks the real slots (shorter rows padded, see `dllm.cache.index_rows`)."""

    index: slice | Tensor
    valid: Tensor | None = None

    @property
    def is_slice(self) -> bool:
        return isinstance(self.index, slice)


def canvas_index(rows: Rows, index: Tensor) -> Tensor:
    """Canvas positions of `index` `[B, C]`, given as indices into the active `rows`."""
    if rows.is_slice:
        return index + rows.index.start
    return rows.index[index] if rows.index.dim() == 1 else rows.index.gather(1, index)


class KVAccess(Protocol):
    """What a cache gives the forward (spec `dkv_elastic_cache.md` section 9), called once per layer with the
    forward's `rows`:

    - `expand(layer, rows, x)`: sees the layer input of the active rows; returns `(x, positions)` of *all*
      canvas rows to recompute everything from this layer on (Elastic-Cache), or None.
    - `update(layer, rows, q, k, v)`: writes the fresh post-RoPE K/V (and, for caches that keep them, queries)
      of the active rows, returns the keys/values the queries attend to (`[B, Hkv, Lk, D]`).
    - `attention_rows(layer, rows)`: indices into the active rows whose attention probabilities the cache
      wants, delivered to `observe_attention(layer, rows, probs [B, H, R, Lk])`; None for none.
    - `layer_rows(layer, rows, x)`: sees the layer input of the active rows; returns the `[B, S]` indices into
      them of the rows that go through this layer (dLLM-Cache), or None: all of them, as one layer. Given
      indices, the layer computes those rows alone and hands their attention-branch and feed-forward-branch
      outputs `[B, S, d]` to `layer_output(layer, through, x, attended, fed)`, which returns every active row's
      layer output (the cache supplies the other rows' branch outputs).
    - `observe_output(rows, x)`: sees the last layer's output of the active rows (d2Cache's confidences).
    """

    def expand(self, layer: int, rows: Rows, x: Tensor) -> tuple[Tensor, Tensor] | None: ...

    def update(self, layer: int, rows: Rows, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...

    def attention_rows(self, layer: int, rows: Rows) -> Tensor | None: ...

    def observe_attention(self, layer: int, rows: Rows, probs: Tensor) -> None: ...

    def layer_rows(self, layer: int, rows: Rows, x: Tensor) -> Tensor | None: ...

    def layer_output(self, layer: int, through: Tensor, x: Tensor, attended: Tensor, fed: Tensor) -> Tensor: ...

    def observe_output(self, rows: Rows, x: Tensor) -> None: ...


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) in fp32, cast back, then scaled by the weight (Llama's order). The fp32 part is
    `F.rms_norm` without a weight: on CUDA torch's one fused kernel instead of five; on a CPU the same five ops."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype) * self.weight


def end_ids(hf: dict, eos: int, end_of_turn: int | None) -> dict:
    """`pad_id`, `stop_ids` and `filler_id` of a config.json. `eos_token_id` (else `eos`) is one id or a list:
    every one ends an answer and the first fills the canvas after it; the end-of-turn token ends an answer too;
    the pad id defaults to the first."""
    value = hf.get("eos_token_id", eos)
    ids = tuple(value) if isinstance(value, list) else (value,)
    if not ids or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ValueError(f"eos_token_id must be a token id or a list of them, got {value!r}")
    turn = () if end_of_turn is None else (end_of_turn,)
    return {"pad_id": hf.get("pad_token_id", ids[0]), "stop_ids": tuple(sorted({*ids, *turn})), "filler_id": ids[0]}


def block_size_of(hf: dict, key: str, default: int | None = None) -> int:
    """The attention block of a block-causal config.json: a positive integer, or the network is another one."""
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be a positive integer (the attention block of this block-causal model), "
                         f"got {value!r}")
    return value


def rope_frequencies(cfg: ModelConfig, device=None) -> Tensor:
    """RoPE inverse frequencies (fp32) of the rotated dims, computed in fp64."""
    if cfg.yarn is not None:
        return cfg.yarn.frequencies(cfg.rope_theta, cfg.rope_dim, device)
    exponent = torch.arange(0, cfg.rope_dim, 2, dtype=torch.float64, device=device) / cfg.rope_dim
    return (cfg.rope_theta ** -exponent).float()


def qkv_sizes(cfg: ModelConfig) -> tuple[int, int, int]:
    return cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim


def shard_rows(cfg: ModelConfig, shard: str, rows: int) -> slice:
    """The rows of a fused projection of `rows` rows that hold one checkpoint tensor (`q`, `k`, `v` of qkv;
    `gate`, `up`: the halves of a gate|up weight; name tables write them `layers.{i}.qkv_proj.weight:q`)."""
    if shard in ("gate", "up"):
        return slice(0, rows // 2) if shard == "gate" else slice(rows // 2, rows)
    q, kv, _ = qkv_sizes(cfg)
    return {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}[shard]


def fused_linear(x: Tensor, layer: nn.Linear, sizes: tuple[int, ...], per_part: bool | None = None
                 ) -> tuple[Tensor, ...]:
    """The parts of a fused projection (queries and keys | values, gate | up): one matmul on a GPU; on a CPU
    (`per_part`) one matmul per part on the weight's contiguous row blocks, which measured 4-10% faster there
    (oneDNN, llada-small). A quantized weight: one matmul (its activations quantized once)."""
    if per_part is None:
        per_part = not x.is_cuda and not is_quantized(layer.weight)
    if not per_part:
        return layer(x).split(sizes, dim=-1)
    biases = (None,) * len(sizes) if layer.bias is None else layer.bias.split(sizes)
    return tuple(F.linear(x, w, b) for w, b in zip(layer.weight.split(sizes), biases))


def head(x: Tensor, weight: Tensor) -> Tensor:
    """The vocabulary projection `x @ weight.T`. On a CPU, for up to 256 rows, computed as `(weight @ x.T).T`:
    measured 1.1-3.5x faster there for a 32k vocabulary (MKL; 32 rows 49 -> 31 ms), 5% slower from 512 rows.
    A quantized head goes through its own linear kernel."""
    flat = x.reshape(-1, x.shape[-1])
    if x.is_cuda or flat.shape[0] > 256 or is_quantized(weight):
        return F.linear(x, weight)
    return (weight @ flat.T).T.contiguous().reshape(*x.shape[:-1], weight.shape[0])


def rope_tables(positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """cos and the signed sin `[B, 1, A, R]` of `rope` for `[B, A]` positions and `[R / 2]` inverse frequencies."""
    angles = positions.float()[..., None] * inv_freq
    cos, sin = angles.cos(), angles.sin()
    return torch.cat((cos, cos), dim=-1)[:, None], torch.cat((-sin, sin), dim=-1)[:, None]


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE in fp32 (LLaDA's `rope_full_precision`); x `[B, H, A, D]`, cos and the signed sin
    `[B, 1, A, R]` (a table of `rope_tables`): the first R dims rotate, the rest pass through (partial RoPE,
    LLaDA2). rotate_half(x) * sin is computed as roll(x) * (-sin, sin): the same products, two kernels fewer."""
    r = cos.shape[-1]
    xf = x[..., :r].float()
    out = (xf * cos + xf.roll(r // 2, -1) * sin).to(x.dtype)
    return out if r == x.shape[-1] else torch.cat((out, x[..., r:]), dim=-1)


def visible_keys(cfg: ModelConfig, query_positions: Tensor, key_positions: Tensor, key_mask: Tensor | None,
                 window: tuple[Tensor, Tensor] | None = None) -> Tensor | None:
    """Which keys each query sees, bool, broadcastable to `[B, 1, A, Lk]`: `key_mask` (padding); on a
    block-causal model (SDAR) only keys whose block (position // block_size) is not after the query's; on a
    causal-prefix model given the positions being decoded, `window` = (first, end) `[B]`, keys up to the query's
    own position, and for a query inside the window every key before the window's end (without a window the
    whole canvas is being decoded: every key); on a causal model keys whose position (rank) is at most the query's."""
    if cfg.causal:
        seen = key_positions[:, None, None, :] <= query_positions[:, None, :, None]
        return seen if key_mask is None else seen & key_mask
    if cfg.causal_prefix and window is not None:
        first, end = (bound[:, None, None, None] for bound in window)
        q, k = query_positions[:, None, :, None], key_positions[:, None, None, :]
        seen = (k <= q) | ((q >= first) & (q < end) & (k < end))
        return seen if key_mask is None else seen & key_mask
    if not cfg.block_size:
        return key_mask
    seen = (key_positions // cfg.block_size)[:, None, None, :] <= (query_positions // cfg.block_size)[:, None, :, None]
    return seen if key_mask is None else seen & key_mask


def attention_probabilities(q: Tensor, k: Tensor, key_mask: Tensor | None) -> Tensor:
    """softmax(q k^T / sqrt(D)) in fp32, `[B, H, R, Lk]`, for queries `[B, H, R, D]` and keys `[B, Hkv, Lk, D]`
    (GQA heads expanded); fused SDPA cannot return probabilities, so this is the small explicit path."""
    k = k.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q.float() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask, float("-inf"))
    return scores.softmax(-1)


class Block(nn.Module):
    """One layer. Its work before and after attention are nested compile regions: `torch.compile` traces and
    compiles each once and stamps it out for every layer of the same kind (a 32-layer model compiled 2.4x faster
    on a CPU, BENCHMARKS.md); the cache's store write and attention stay in the calling graph. Eager: plain calls."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        d = cfg.hidden_size
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q, kv, _ = qkv_sizes(cfg)
        self.qk_v_sizes, self.gate_up_sizes = (q + kv, kv), (cfg.intermediate_size,) * 2
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(d, q + 2 * kv, bias=cfg.qkv_bias)  # q, k, v in one matmul
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, d, bias=False)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps), RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.mlp_norm = RMSNorm(d, cfg.rms_norm_eps)
        if cfg.is_moe_layer(layer):
            self.moe = MoE(d, cfg.moe)
        else:
            self.gate_up_proj = nn.Linear(d, sum(self.gate_up_sizes), bias=False)  # gate, up in one matmul
            self.down_proj = nn.Linear(cfg.intermediate_size, d, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, key_mask: Tensor | None,
                kv: KVAccess | None, rows: Rows, layer: int) -> Tensor:
        return self.output_and_mlp(x, self.attend(x, cos, sin, key_mask, kv, rows, layer))

    def attend(self, x: Tensor, cos: Tensor, sin: Tensor, key_mask: Tensor | None, kv: KVAccess | None, rows: Rows,
               layer: int) -> Tensor:
        """The attention `[B, H, A, D]` of the rows `x` over the keys and values the cache returns (theirs alone
        without a cache)."""
        qk, v = self.attention_inputs(x, cos, sin)
        q, k = qk.split((self.n_heads, self.n_kv_heads), 1)
        if kv is not None:
            k, v = kv.update(layer, rows, q, k, v)
            probe = kv.attention_rows(layer, rows)
            if probe is not None:
                kv.observe_attention(layer, rows, self.attention_probs(q, k, key_mask, probe))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, enable_gqa=self.n_heads != self.n_kv_heads)

    @torch.compiler.nested_compile_region
    def attention_inputs(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Post-RoPE queries and keys in one tensor `[B, H + Hkv, A, D]` (a region returns no two views of one
        tensor), and the values `[B, Hkv, A, D]`: the projection's query and key columns stay together, so one
        RoPE call takes both without a copy."""
        qk, v = fused_linear(self.attn_norm(x), self.qkv_proj, self.qk_v_sizes)
        qk = qk.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        v = v.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = qk.split((self.n_heads, self.n_kv_heads), 1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), 1)
        if cos.shape[1] == 2:  # the queries' own tables (their scale folded in, `DiffusionLM.rope_tables`)
            q, k = qk.split((self.n_heads, self.n_kv_heads), 1)
            return torch.cat((rope(q, cos[:, 1:], sin[:, 1:]), rope(k, cos[:, :1], sin[:, :1])), 1), v
        return rope(qk, cos, sin), v

    @torch.compiler.nested_compile_region
    def output_and_mlp(self, x: Tensor, o: Tensor) -> Tensor:
        """The attention output `o` `[B, H, A, D]` projected into the residual stream, then the feed-forward."""
        x = x + self.attention_output(o)
        return x + self.feed_forward(x)

    def branches(self, x: Tensor, o: Tensor) -> tuple[Tensor, Tensor]:
        """What `output_and_mlp` adds to `x`, kept apart: the attention branch's output and the feed-forward
        branch's output on the residual after it, `[B, A, d]` each."""
        attended = self.attention_output(o)
        return attended, self.feed_forward(x + attended)

    def attention_output(self, o: Tensor) -> Tensor:
        return self.o_proj(o.transpose(1, 2).flatten(2))

    def feed_forward(self, x: Tensor) -> Tensor:
        h = self.mlp_norm(x)
        if hasattr(self, "moe"):
            return self.moe(h)
        gate, up = fused_linear(h, self.gate_up_proj, self.gate_up_sizes)
        return self.down_proj(F.silu(gate) * up)

    def values(self, x: Tensor) -> Tensor:
        """The values `[B, Hkv, A, D]` of the rows `x` alone (dLLM-Cache's V-verify)."""
        h, proj, start = self.attn_norm(x), self.qkv_proj, self.qk_v_sizes[0]
        if is_quantized(proj.weight):
            v = fused_linear(h, proj, self.qk_v_sizes)[1]
        else:  # the value rows of the fused weight only (what `fused_linear` computes for them on a CPU)
            v = F.linear(h, proj.weight[start:], None if proj.bias is None else proj.bias[start:])
        return v.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)

    def attention_probs(self, q: Tensor, k: Tensor, key_mask: Tensor | None, probe: Tensor) -> Tensor:
        """Softmax attention of the query rows `probe` `[B, R]` (fp32), `[B, H, R, Lk]`."""
        index = probe[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[-1])
        return attention_probabilities(q.gather(2, index), k, key_mask)


class Network(nn.Module):
    """What every network shares: its config, the decoding defaults of its checkpoint directory, an embedding
    `embed` and LM head `lm_head` (tied when the config says so), its device and float type."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.generation_defaults = GenerationConfig()  # its directory's generation_config.json (dllm.loading)
        self.threads: dict[str, int | str] = {}  # the CPU thread count `dllm.load` set, and why (models.threads)
        self.quantization: dict | None = None  # {"scheme": "int8", "head": False} once quantized (quantize.py)
        self.tp = None  # a tensor-parallel model's `sharding.Shard` (this rank's heads, experts, vocabulary rows)

    def init_buffers(self) -> None:
        """Ties and computed buffers, again after `to_empty` (which leaves them unset); subclasses add theirs."""
        if self.config.tied_head:
            self.lm_head.weight = self.embed.weight

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype


class DiffusionLM(Network):
    """A LLaDA or Dream network. `forward(input_ids)` returns position-aligned logits for the whole canvas;
    the decode loop uses `run` to compute only active rows against a cache."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        super().init_buffers()
        self.inv_freq = rope_frequencies(self.config, self.inv_freq.device)

    def kv_shapes(self) -> list[tuple[int, int]]:
        """Key/value heads (this rank's, tensor parallel) and head size of every layer (a cache's store is shaped by
        them)."""
        return [(layer.n_kv_heads, layer.head_dim) for layer in self.layers]

    def visible_keys(self, query_positions: Tensor, key_positions: Tensor, key_mask: Tensor | None,
                     window: tuple[Tensor, Tensor] | None = None) -> Tensor | None:
        """`run`'s key mask: `visible_keys` of this network's config."""
        return visible_keys(self.config, query_positions, key_positions, key_mask, window)

    def rope_tables(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and the signed sin `[B, 1, A, R]` of `rope` for `[B, A]` positions, times YaRN's attention factor.
        With a query scale, `[B, 2, A, R]`: the keys' tables, then the queries' with their scale
        `1 + beta * log(1 + floor(position / length))` folded in (RoPE is linear, so scaling after it is scaling
        its tables)."""
        cfg = self.config
        cos, sin = rope_tables(positions, self.inv_freq)
        if cfg.yarn is not None and cfg.yarn.attention_factor != 1:
            cos, sin = cos * cfg.yarn.attention_factor, sin * cfg.yarn.attention_factor
        if cfg.query_scale is None:
            return cos, sin
        beta, length = cfg.query_scale
        scale = (1 + beta * torch.log1p(torch.floor(positions.float() / length)))[:, None, :, None]
        return torch.cat((cos, cos * scale), 1), torch.cat((sin, sin * scale), 1)

    def run(self, tokens: Tensor, positions: Tensor, key_mask: Tensor | None, kv: KVAccess | None = None,
            rows: Rows | None = None, logit_rows: Tensor | None = None) -> Tensor:
        """Push the active rows through the network.

        tokens, positions: `[B, A]` ids and RoPE positions of the active rows. key_mask: bool
        `[B, 1, 1 or A, Lk]` over the keys the queries see (None = all visible; `visible_keys`). kv: the cache's
        key/value supply (None = the active rows are the only keys). rows: which canvas rows the active ones are
        (None = all). logit_rows: `[B, C]` indices into the active rows whose hidden states go through the head
        (None = all). Returns raw (unshifted) logits `[B, C, V]`.
        """
        rows = Rows(slice(0, tokens.shape[1])) if rows is None else rows
        x = self.embed(tokens)
        cos, sin = self.rope_tables(positions)
        for i, layer in enumerate(self.layers):
            grown = None if kv is None else kv.expand(i, rows, x)
            if grown is not None:  # every canvas row from this layer on
                x, positions = grown
                cos, sin = self.rope_tables(positions)
                if logit_rows is not None:
                    logit_rows = canvas_index(rows, logit_rows)
                rows = Rows(slice(0, x.shape[1]))
            through = None if kv is None else kv.layer_rows(i, rows, x)
            if through is None:
                x = layer(x, cos, sin, key_mask, kv, rows, i)
            else:  # the cache's choice of rows, the other rows' outputs from the cache
                branches = self.layer_branches(i, x, through, positions, key_mask, kv, rows)
                x = kv.layer_output(i, through, x, *branches)
        if kv is not None:
            kv.observe_output(rows, x)
        if logit_rows is not None:
            x = x.gather(1, logit_rows[..., None].expand(-1, -1, x.shape[-1]))
        return head(self.norm(x), self.lm_head.weight)

    def layer_branches(self, layer: int, x: Tensor, through: Tensor, positions: Tensor, key_mask: Tensor | None,
                       kv: KVAccess, rows: Rows) -> tuple[Tensor, Tensor]:
        """Layer `layer`'s attention-branch and feed-forward-branch outputs `[B, S, d]` of the rows `through`
        (`[B, S]` indices into the active rows `x`, `positions`) alone, against the cache's keys and values."""
        if not through.shape[1]:
            return x[:, :0], x[:, :0]
        block = self.layers[layer]
        chosen = x.gather(1, through[..., None].expand(-1, -1, x.shape[-1]))
        cos, sin = self.rope_tables(positions.gather(1, through))
        if key_mask is not None and key_mask.shape[2] > 1:  # a mask per query row
            key_mask = key_mask.gather(2, through[:, None, :, None].expand(-1, key_mask.shape[1], -1,
                                                                           key_mask.shape[3]))
        o = block.attend(chosen, cos, sin, key_mask, kv, Rows(canvas_index(rows, through)), layer)
        return block.branches(chosen, o)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                window: tuple[int, int] | None = None) -> Tensor:
        """Logits `[B, L, V]` aligned to positions (logits[:, i] scores token i; Dream's shift applied).
        attention_mask `[B, L]` (1 = real token) marks left padding; positions count real tokens only. window:
        the columns `[lo, hi)` being decoded on a causal-prefix model (default: all of them; `visible_keys`)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        attention_mask = attention_mask.bool()
        positions = (attention_mask.long().cumsum(1) - 1).clamp(min=0)
        key_mask = None if attention_mask.all() else attention_mask[:, None, None, :]
        if window is not None:
            window = (positions[:, window[0]], positions[:, window[1] - 1] + 1)
        key_mask = visible_keys(self.config, positions, positions, key_mask, window)
        logits = self.run(input_ids, positions, key_mask, kv=None)
        if self.config.logit_shift:
            logits = torch.cat((logits[:, :1], logits[:, :-1]), dim=1)
        return logits
