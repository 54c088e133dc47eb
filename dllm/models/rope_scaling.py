"""YaRN RoPE scaling (Peng et al., arXiv 2309.00071) as transformers computes it (`_compute_yarn_parameters`),
attention factor included: Ministral 3 and Nemotron-Labs-Diffusion extend a 16k context 16 times with it."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class YaRN:
    """A rotated dim whose wavelength fits more than `beta_fast` times into `original_length` positions keeps its
    frequency, one that fits fewer than `beta_slow` times has it divided by `factor`, the dims between are mixed
    along a linear ramp; cos and sin are multiplied by `attention_factor`."""

    factor: float
    original_length: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True  # the ramp's ends rounded outward to whole dims

    def __post_init__(self):
        for name in ("factor", "beta_fast", "beta_slow", "attention_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"YaRN {name} must be a positive number, got {value!r}")
        if isinstance(self.original_length, bool) or not isinstance(self.original_length, int) or \
                self.original_length < 1:
            raise ValueError(f"YaRN original_max_position_embeddings must be a positive integer, got "
                             f"{self.original_length!r}")

    def frequencies(self, theta: float, dim: int, device=None) -> Tensor:
        """Inverse frequencies (fp32, computed in fp64) of `dim` rotated dims."""
        base = theta ** -(torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)

        def dim_turning(times: float) -> float:  # the (fractional) dim whose wavelength fits `times` times
            return dim * math.log(self.original_length / (times * 2 * math.pi)) / (2 * math.log(theta))

        low, high = dim_turning(self.beta_fast), dim_turning(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        interpolated = ((torch.arange(dim // 2, dtype=torch.float64, device=device) - low) / (high - low)).clamp(0, 1)
        return (base * (1 - interpolated + interpolated / self.factor)).float()

    @classmethod
    def from_hf(cls, rope: dict, max_length: int) -> "YaRN":
        """From a config.json's `rope_parameters` (`rope_scaling` before transformers 5). Without an explicit
        `attention_factor` it is 0.1 ln(factor) + 1, or that ratio of `mscale` to `mscale_all_dim` when both are
        given (1.0 for the released Ministral 3 and Nemotron configs)."""
        original = rope["original_max_position_embeddings"]
        factor = rope.get("factor") or max_length / original
        attention = rope.get("attention_factor")
        if attention is None:
            mscale, all_dims = rope.get("mscale"), rope.get("mscale_all_dim")
            attention = _mscale(factor, mscale) / _mscale(factor, all_dims) if mscale and all_dims else _mscale(factor)
        return cls(float(factor), original, float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1),
                   float(attention), bool(rope.get("truncate", True)))

    def to_hf(self, theta: float) -> dict:
        return {"rope_type": "yarn", "rope_theta": theta, "factor": self.factor,
                "original_max_position_embeddings": self.original_length, "beta_fast": self.beta_fast,
                "beta_slow": self.beta_slow, "attention_factor": self.attention_factor, "truncate": self.truncate}


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
