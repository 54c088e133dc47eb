"""d2Cache's certainty density (Jiang et al., arXiv 2509.23094; Kamichanw/d2Cache `src/utils/common.py`), which the
`certainty_prior` sampler and the `d2cache` cache both score masked positions with."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def certainty_density(decoded: Tensor, sigma: float) -> Tensor:
    """`[B, G]` float32: around each of G answer positions, the Gaussian-weighted (std `sigma`) share of decoded
    positions, `decoded` `[B, G]` bool. The answer is extended by G positions on each side, the left ones (the
    prompt) decoded, the right ones as the last answer position is: D_i = sum_j ext_j K(i - j) / sum_{d=-3G}^{3G-1}
    K(d), K(d) = exp(-d^2 / 2 sigma^2), both sums by a float32 FFT over 6G points as the authors compute them, so
    that near-equal scores order as theirs do."""
    batch, length = decoded.shape
    span = 3 * length
    extended = F.pad(decoded.float(), (length, length), value=1.0)
    extended[~decoded[:, -1], 2 * length:] = 0.0
    offsets = torch.cat((torch.arange(span, device=decoded.device), torch.arange(-span, 0, device=decoded.device)))
    kernel = torch.fft.fft(torch.exp(-(offsets ** 2) / (2 * sigma ** 2)), n=2 * span)

    def convolved(signal: Tensor) -> Tensor:
        return torch.fft.ifft(torch.fft.fft(signal, n=2 * span) * kernel, n=2 * span).real[:, length:2 * length]

    weighted = convolved(F.pad(extended, (0, span)))
    total = convolved(torch.ones(batch, 2 * span, device=decoded.device))
    return weighted / total.clamp_min(1e-8)
