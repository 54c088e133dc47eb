"""A transcription of WeDLM's engine loop (Tencent/WeDLM `wedlm/engine/wedlm_decoder.py`, `model_runner.py`,
`sampler.py`; spec `wedlm.md` 2.2-2.6) for one prompt at temperature 0, without paged memory: every step recomputes
`[prompt ; committed ; reordered window]` under one causal mask over the physical order, with RoPE at the true
positions (the spec's full-recompute form, token for token the engine's cached one). It runs on our network's
`run(tokens, positions, key_mask)`, and is the yardstick the decode loop's window layout is tested against.

Kept as the engine does it (spec section 6):
- a mask's own row predicts it; the prompt's logits are never read (so no prefill is run here);
- the masks are refilled before the forward: a step feeds W + p rows, p = the window's leading filled run, and
  fills among the W masks after the frontier that this step's commit moves;
- the fill rule reads the entropy of the raw logits in their dtype, `entropy + lambda * (slot - first mask slot)`,
  strictly below tau, else the lowest (first on ties); tau None fills one;
- a filled slot is a flag, not `token != mask id`: a predicted mask id is a token like any other and is output;
- nothing clips the window at `max_tokens` or after a stop: those slots are predicted, filled and seen by the
  masks before them; a stop or the `max_tokens`-th token ends the request only in the forward that commits it (one
  forward more than the canvas form needs, and the engine's `decode_forwards` does not count it);
- the output keeps the first stop token and is cut there, or at `max_tokens`; `decode_tokens` counts the whole
  committed run of the last step (it may exceed `max_tokens`)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Trace:
    tokens: list[int]  # the answer: cut after the first stop id (kept) or at max_tokens
    forwards: int = 0  # decode forwards, the final commit-only one included
    rows: list[int] = field(default_factory=list)  # window rows fed per forward (W + p)
    fills: list[list[tuple[int, int]]] = field(default_factory=list)  # per forward: (answer position, token) filled
    decode_tokens: int = 0  # committed tokens, the last step's run uncut (the engine's statistic)

    @property
    def engine_decode_forwards(self) -> int:
        """What the engine reports: its statistic counts the rows still running after a step."""
        return self.forwards - 1


@torch.no_grad()
def wedlm_reference(model, prompt: list[int], window_size: int = 16, entropy_threshold: float | None = 0.4,
                    pos_penalty: float = 0.02, max_tokens: int = 64, stop_ids: tuple[int, ...] = ()) -> Trace:
    mask = model.config.mask_id
    start = len(prompt)  # P
    committed: list[int] = []  # the answer tokens whose K/V the engine has cached
    slots, unfilled = [mask] * window_size, [True] * window_size
    trace = Trace(tokens=[])
    while True:
        lead = unfilled.index(True) if True in unfilled else len(slots)  # the leading filled run, p
        slots += [mask] * lead  # refill before the forward
        unfilled += [True] * lead
        order = [i for i in range(len(slots)) if not unfilled[i]] + [i for i in range(len(slots)) if unfilled[i]]
        frontier = start + len(committed)
        ids = prompt + committed + [slots[i] for i in order]
        positions = list(range(frontier)) + [frontier + i for i in order]
        n = len(ids)
        causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        logits = model.run(torch.tensor([ids]), torch.tensor([positions]), causal)[0, frontier:]
        trace.forwards += 1
        trace.rows.append(len(order))
        observed = len(order) - sum(unfilled)
        for i, token in enumerate(slots[:lead]):  # commit the leading run, one token at a time
            committed.append(token)
            stop = token in stop_ids
            if stop or len(committed) >= max_tokens:
                trace.tokens = committed
                trace.decode_tokens += i + 1 if stop else lead  # a stop cuts the step's run, max_tokens does not
                trace.fills.append([])
                return trace
        trace.decode_tokens += lead
        del slots[:lead], unfilled[:lead]
        remaining = [i for i in range(len(slots)) if unfilled[i]]  # remaining[0] == 0
        mask_logits = logits[observed:]  # row k predicts slot remaining[k]
        entropy = torch.distributions.Categorical(logits=mask_logits).entropy()
        scores = entropy + pos_penalty * (torch.tensor(remaining) - remaining[0])
        chosen = [] if entropy_threshold is None else (scores < entropy_threshold).nonzero()[:, 0].tolist()
        chosen = chosen or [int(scores.argmin())]
        tokens = mask_logits.softmax(-1).argmax(-1)
        step = []
        for k in chosen:
            slot = remaining[k]
            slots[slot], unfilled[slot] = int(tokens[k]), False
            step.append((frontier + lead - start + slot, int(tokens[k])))
        trace.fills.append(step)

