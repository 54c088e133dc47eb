"""What the loop and the cache count (never estimate): `Stats` of a generation and a traced step."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass
class Stats:
    """Counted by the loop and the cache, never estimated."""

    nfe: int = 0  # forwards (every model call)
    full_forwards: int = 0  # forwards that recomputed the whole canvas
    gen_tokens: int = 0  # tokens committed by the sampler, less those it masked again (WINO); filler after a finished
    # answer excluded
    seconds: float = 0.0
    rows_per_layer: list[int] = field(default_factory=list)  # token rows computed per layer (batch summed)
    cache_bytes: int = 0  # bytes held by the K/V store
    forward_seconds: dict[str, list[float]] = field(default_factory=dict)  # per forward, by kind (profile=True)

    @property
    def tpf(self) -> float:
        """Tokens per forward, per sequence."""
        return self.gen_tokens / max(self.nfe, 1) / max(self.batch, 1)

    @property
    def tokens_per_second(self) -> float:
        return self.gen_tokens / self.seconds if self.seconds > 0 else 0.0

    batch: int = 1

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tpf": self.tpf, "tokens_per_second": self.tokens_per_second}


def trace_step(block, step, rows_per_layer, candidates, commit, out, logits, edited=None, given_up=None) -> dict:
    """A step's record: per row its commits (masked positions given a token), for token-editing samplers
    (`edited` `[B, C]`) the decoded positions it rewrote, and for samplers that give masks up (`given_up` `[B, C]`)
    the positions left masked for good."""
    top2 = torch.softmax(logits.double(), -1).topk(2, dim=-1).values
    gap = top2[..., 0] - top2[..., 1]
    record = {"block": block, "step": step, "rows_per_layer": rows_per_layer,
              "commits": [[{"position": int(candidates[c]), "token": int(out.tokens[b, c]),
                            "confidence": float(out.confidence[b, c]), "top2_gap": float(gap[b, c])}
                           for c in commit[b].nonzero()[:, 0].tolist()] for b in range(commit.shape[0])]}
    if edited is not None:
        record["edits"] = [[{"position": int(candidates[c]), "token": int(out.tokens[b, c])}
                            for c in edited[b].nonzero()[:, 0].tolist()] for b in range(edited.shape[0])]
    if given_up is not None:
        record["given_up"] = [candidates[given_up[b]].tolist() for b in range(given_up.shape[0])]
    return record
