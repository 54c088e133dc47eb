"""LLaDA's sampler-independent generation options (ML-GSAI/LLaDA `generate.py`; paper Appendix B.4, the settings
of its EVAL.md tables): classifier-free guidance, EOS forbidden, EOS and EoT scored last. The runner applies
the first two to the logits it returns; the loop gives the third to the sampler's step (`StepContext.unscored`,
which `token_probability` reads)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from ..core.errors import DllmError
from ..models import ModelConfig
from ..models.sharded_logits import set_column


@dataclass(frozen=True)
class Guidance:
    """`cfg_scale` > 0: every forward also runs each row with its prompt masked (its own rows of the batch and of
    the K/V store) and the logits become `uncond + (cfg_scale + 1) * (cond - uncond)`. `logits_eos_inf`: EOS
    (the model's first eos id) can never be proposed. `confidence_eos_eot_inf`: a position whose proposal is EOS
    or EoT (the other stop ids) is scored 0 and the others without their mass; at temperature > 0 EoT only, as
    the reference's chained assignment does (its EOS line writes noisy logits no longer read)."""

    cfg_scale: float = 0.0
    logits_eos_inf: bool = False
    confidence_eos_eot_inf: bool = False

    def __post_init__(self):
        scale = self.cfg_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale < 0:
            raise DllmError(f"cfg_scale must be a number >= 0 (0: no guidance), got {scale!r}")
        object.__setattr__(self, "cfg_scale", float(scale))
        for name in ("logits_eos_inf", "confidence_eos_eot_inf"):
            if not isinstance(getattr(self, name), bool):
                raise DllmError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def guided(self) -> bool:
        return self.cfg_scale > 0

    def config(self) -> dict:
        return asdict(self)

    def combine(self, logits: Tensor) -> Tensor:
        """`[N, 2, ...]` logits of each row and its unconditional copy -> the guided `[N, ...]`."""
        cond, uncond = logits.unbind(1)
        return uncond + (self.cfg_scale + 1) * (cond - uncond)

    def ban(self, logits: Tensor, cfg: ModelConfig, tp=None) -> None:
        """`logits_eos_inf`, in place (on a tensor-parallel model's rank `tp`, its vocabulary columns)."""
        if self.logits_eos_inf:
            set_column(logits, cfg.filler_id, float("-inf"), tp)

    def unscored(self, cfg: ModelConfig, temperature: float | Tensor, device: torch.device) -> Tensor | None:
        """The token ids `token_probability` leaves out under `confidence_eos_eot_inf` (None: off); for rows with
        their own temperatures (`[B]`, `samplers.stack_rows`) a `[B, V]` mask, each row's ids by its own."""
        if not self.confidence_eos_eot_inf:
            return None
        eot = [i for i in cfg.stop_ids if i != cfg.filler_id and i < cfg.vocab_size]
        if not isinstance(temperature, Tensor):
            return torch.tensor(eot if temperature > 0 else [cfg.filler_id, *eot], device=device)
        mask = torch.zeros(len(temperature), cfg.vocab_size, dtype=torch.bool, device=device)
        mask[:, eot] = True
        mask[:, cfg.filler_id] = (temperature == 0).to(device)
        return mask


def unconditional(tokens: Tensor, prompt_columns: Tensor, mask_id: int) -> Tensor:
    """`tokens` `[B, K, L]` (K copies of each canvas row) with every prompt column (`[B, L]`, left padding
    included) masked, as LLaDA's `un_x`."""
    return tokens.masked_fill(prompt_columns[:, None, :], mask_id)
