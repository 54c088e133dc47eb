"""Mixture-of-experts feed-forward layers (spec `block_diffusion_moe.md` sections 2-3).

Three routers: LLaDA-MoE's softmax router (Qwen3-MoE's, `norm_topk_prob` off, an optional expert bias added to
the probabilities), LLaDA2's sigmoid group-limited router (DeepSeek-V3's "noaux_tc": the expert bias only
chooses, the unbiased sigmoid scores weigh, renormalised and scaled) and Gemma 4's (DiffusionGemma; spec
`new_families.md` section 1: a softmax over the RMS-normalised input times a learned per-channel scale and
hidden^-0.5, top-k renormalised, each weight times its expert's learned scale; it may route on another input than
the experts compute on). Routed experts are SwiGLUs (Gemma: GeGLUs, tanh GELU) stored stacked (`[E, 2F, D]`
gate|up, `[E, D, F]` down) and computed grouped by expert: the token copies are sorted by
expert and two `F.grouped_mm` calls run every expert's rows, with no loop over tokens or experts and no host
sync, so in bf16 the layer compiles into the model's graph (`--compile`). Shared experts are one dense SwiGLU
added to the routed output.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .quantize import dense


@dataclass(frozen=True)
class MoEConfig:
    n_experts: int
    top_k: int
    expert_size: int  # each routed expert's SwiGLU width (moe_intermediate_size)
    shared_size: int = 0  # width of the shared experts' SwiGLU (0: none)
    dense_layers: int = 0  # the first layers keep a dense SwiGLU of ModelConfig.intermediate_size (LLaDA2: 1)
    router: Literal["softmax", "sigmoid", "gemma"] = "softmax"
    expert_bias: bool = False  # softmax: added to the probabilities; sigmoid: added to the scores that choose
    groups: int = 1  # sigmoid: experts in groups; only the `groups_kept` best groups (sum of top 2) are eligible
    groups_kept: int = 1
    normalize: bool = False  # the chosen weights renormalised to sum 1 (norm_topk_prob)
    scaling: float = 1.0  # routed_scaling_factor
    activation: Literal["silu", "gelu_tanh"] = "silu"  # of the experts' gate (Gemma 4: gelu_pytorch_tanh)
    norm_eps: float = 1e-6  # gemma: of the router's RMS normalisation

    def routed_parameters(self, d: int) -> int:
        """Parameters of one layer's routed experts (what a forward reads only for the experts chosen)."""
        return self.n_experts * 3 * d * self.expert_size

    def layer_parameters(self, d: int) -> int:
        """Parameters of one MoE layer (router, bias or scales, routed and shared experts)."""
        scales = d + self.n_experts if self.router == "gemma" else 0
        return self.n_experts * (d + self.expert_bias) + scales + self.routed_parameters(d) + 3 * d * self.shared_size


def swiglu_names(checkpoint: str, gate_up: str, down: str) -> dict[str, str]:
    """Name-table entries of a SwiGLU stored as `{checkpoint}{gate,up,down}_proj.weight`: gate and up into the
    halves of our `gate_up` tensor, down into `down` (for a routed expert: `...experts_gate_up@{e}`)."""
    return {checkpoint + "gate_proj.weight": gate_up + ":gate", checkpoint + "up_proj.weight": gate_up + ":up",
            checkpoint + "down_proj.weight": down}


def grouped_matmul(x: Tensor, weights: Tensor, ends: Tensor) -> Tensor:
    """Rows `ends[e-1]:ends[e]` of `x` times `weights[e]`: one `F.grouped_mm` for bf16 (the CUDA kernel's only
    type) and fp32 on a CPU; otherwise (fp32/fp16 on a GPU, fp64) one matmul per expert, after one host sync."""
    if x.dtype == torch.bfloat16 or (x.device.type == "cpu" and x.dtype == torch.float32):
        return F.grouped_mm(x, weights, offs=ends)
    bounds = [0, *ends.tolist()]
    return torch.cat([x[a:b] @ w for a, b, w in zip(bounds, bounds[1:], weights)])


def gate_activation(gate: Tensor, activation: str) -> Tensor:
    """The gate's nonlinearity: SiLU (SwiGLU) or tanh-approximated GELU (GeGLU, Gemma's gelu_pytorch_tanh)."""
    return F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up as one `[2F, D]` weight (gate first): a SwiGLU, or a GeGLU
    with `activation="gelu_tanh"`."""

    def __init__(self, d: int, f: int, activation: str = "silu"):
        super().__init__()
        self.activation = activation
        self.gate_up_proj = nn.Linear(d, 2 * f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(gate_activation(gate, self.activation) * up)


class MoE(nn.Module):
    def __init__(self, d: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(d, cfg.n_experts, bias=False)
        if cfg.expert_bias:
            self.expert_bias = nn.Parameter(torch.zeros(cfg.n_experts), requires_grad=False)
        if cfg.router == "gemma":
            self.router_scale = nn.Parameter(torch.ones(d))
            self.per_expert_scale = nn.Parameter(torch.ones(cfg.n_experts))
        self.experts_gate_up = nn.Parameter(torch.empty(cfg.n_experts, 2 * cfg.expert_size, d))
        self.experts_down = nn.Parameter(torch.empty(cfg.n_experts, d, cfg.expert_size))
        if cfg.shared_size:
            self.shared = GatedMLP(d, cfg.shared_size)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The chosen experts `[N, K]` of each token of `x` `[N, D]` and their weights (fp32)."""
        cfg = self.cfg
        x = x.float()
        if cfg.router == "gemma":
            x = F.rms_norm(x, x.shape[-1:], eps=cfg.norm_eps) * self.router_scale.float() * x.shape[-1] ** -0.5
        logits = F.linear(x, self.router.weight.float())
        bias = self.expert_bias.float() if cfg.expert_bias else 0.0
        if cfg.router in ("softmax", "gemma"):
            weights, chosen = (logits.softmax(-1) + bias).topk(cfg.top_k, dim=-1)
        else:
            scores = logits.sigmoid()
            choice = scores + bias
            if cfg.groups > 1:
                per_group = choice.unflatten(-1, (cfg.groups, -1))
                best = per_group.topk(2, dim=-1).values.sum(-1).topk(cfg.groups_kept, dim=-1).indices
                kept = torch.zeros_like(per_group[..., 0], dtype=torch.bool).scatter(-1, best, True)
                choice = per_group.masked_fill(~kept[..., None], float("-inf")).flatten(-2)
            chosen = choice.topk(cfg.top_k, dim=-1).indices
            weights = scores.gather(-1, chosen)
        if cfg.normalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        if cfg.router == "gemma":
            weights = weights * self.per_expert_scale.float()[chosen]
        return chosen, weights * cfg.scaling

    def forward(self, x: Tensor, router_input: Tensor | None = None) -> Tensor:
        """The experts' output for `x` `[..., D]`, routed on `router_input` (default: `x` itself)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        chosen, weights = self.route(x if router_input is None else router_input.reshape(-1, shape[-1]))
        routed = self.routed(x, chosen, weights)
        if self.cfg.shared_size:
            routed = routed + self.shared(x)
        return routed.reshape(shape)

    def routed(self, x: Tensor, chosen: Tensor, weights: Tensor) -> Tensor:
        """Each token's weighted sum of its chosen experts' outputs `[N, D]` (`chosen`, `weights` `[N, K]`)."""
        experts, order = chosen.flatten().sort(stable=True)  # token copies grouped by expert
        return self.grouped(x, experts, order, weights, self.cfg.n_experts)

    def grouped(self, x: Tensor, experts: Tensor, order: Tensor, weights: Tensor, count: int) -> Tensor:
        """The routed output of the token copies `order` (indices into the flattened `[N, K]` choices), sorted by
        their experts `experts` (indices into this layer's `count` expert stacks)."""
        token = order // self.cfg.top_k
        ends = torch.searchsorted(experts, torch.arange(count, device=x.device), right=True)
        ends = ends.to(torch.int32)  # where each expert's rows end; a static shape, unlike bincount's
        gate_up, down = dense(self.experts_gate_up), dense(self.experts_down)  # quantized stacks: dequantized
        gate, up = grouped_matmul(x[token], gate_up.transpose(1, 2), ends).chunk(2, dim=-1)
        out = grouped_matmul(gate_activation(gate, self.cfg.activation) * up, down.transpose(1, 2), ends)
        out = out * weights.flatten()[order, None].to(out.dtype)
        return torch.zeros_like(x).index_add_(0, token, out)
