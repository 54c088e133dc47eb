"""PC-Sampler, position-aware calibration of decoding bias (Huang et al., arXiv 2508.13021; spec
`strategies_2026.md` section 3; the authors' NEUIR/PC-Sampler `src/generate.py::generate_with_pc_sampler`,
`pc_sampler_function`, `load_baseline`).

Each masked position of the block is scored exp(-lambda * k) * min(-c * ln(f(x) + 1e-9), alpha): k its index in the
block, x its prediction, c the prediction's probability (softmax in the logits' dtype, as the authors'), f(x) the
token's frequency in a reference corpus (float32; a token the table does not list counts once). The LLaDA schedule's
number of best-scored positions is committed each step. Scores are float32 as theirs: exp(-lambda * k) underflows to 0
for lambda * k >= 104, and `torch.topk` orders equal scores as in the authors' code (torch's order, not the lowest
position first). The authors' code is LLaDA's; on Dream the same rule runs on the aligned logits. position_decay = 0
is the position-free calibration that d2Cache ports (its `debias`), except that d2Cache adds 1e-10, keeps the table in
the logits' dtype and commits one position a step or a threshold's (here: the schedule's count, one a step when
steps = gen_length).

The frequency table belongs to the tokenizer: `token_frequency.json` in the model's directory (`prepare` finds the
directory from the tokenizer; the shipped tiny models have theirs, counted by `scripts/count_token_frequency.py`), or
any file given as `frequency_file`. Format: {"total": N, "counts": {"token id": count, ...}}; the authors' baseline
files ({"num_token": N, "p_baseline_dict": {...}}, `data/baseline/reference_corpus_{llada,dream}.json`) are read as
they are. MASK is never proposed (see `samplers.base`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor

from dllm.core.errors import DllmError
from dllm.core.params import param
from dllm.models.checkpoint import read_json

from .base import Commit, Sampler, StepContext, gumbel_argmax, per_row, quota, register

FREQUENCY_FILE = "token_frequency.json"  # beside a checkpoint's config.json
COUNT_COMMAND = "python scripts/count_token_frequency.py"


@register("pc_sampler")
@dataclass
class PCSampler(Sampler):
    """PC-Sampler (arXiv 2508.13021): commit the scheduled number of masked positions with the best score
    exp(-position_decay * k) * min(-c ln f(x), clip), k the index in the block, f(x) the predicted token's corpus
    frequency (token_frequency.json beside the model). Authors' code: NEUIR/PC-Sampler (lambda 0.25, alpha 10;
    steps = block_length = gen_length in their scripts)."""

    orders_by_token_probability: ClassVar[bool] = False  # by its calibrated, position-weighted score
    position_decay: float = param(0.25, "lambda: the position weight exp(-lambda * k), k the index in the block "
                                        "(0: none)", ge=0.0)
    clip: float = param(10.0, "alpha: the calibrated confidence -c ln f(x) is clipped at this", gt=0.0)
    frequency_file: str | None = param(None, f"token-frequency JSON (None: {FREQUENCY_FILE} in the model's directory)")
    _table: tuple[Tensor, Tensor, int] | None = field(default=None, init=False, repr=False)  # ids, counts, total

    def __post_init__(self):
        super().__post_init__()
        if self.frequency_file is not None:
            path = Path(self.frequency_file).expanduser()
            if not path.is_file():
                raise DllmError(f"sampler 'pc_sampler' frequency_file {self.frequency_file} does not exist; count one "
                                f"with {COUNT_COMMAND} MODEL_DIR --corpus FILE.jsonl")
            self._table = read_table(path)

    def prepare(self, tokenizer) -> None:
        """Read the table beside the tokenizer's model directory (unless `frequency_file` gave one)."""
        if self._table is not None:
            return
        directory = getattr(tokenizer, "name_or_path", "")
        if not directory:
            raise DllmError("sampler 'pc_sampler' reads token_frequency.json from the model's directory, and this "
                            "model has none (a random: model); set frequency_file")
        path = Path(directory) / FREQUENCY_FILE
        if not path.is_file():
            raise DllmError(f"sampler 'pc_sampler' needs the token-frequency table {path}; count it with "
                            f"{COUNT_COMMAND} {directory} --corpus FILE.jsonl (or set frequency_file, e.g. to the "
                            f"authors' reference_corpus_llada.json)")
        self._table = read_table(path)

    def step(self, ctx: StepContext) -> Commit:
        if self._table is None:
            raise DllmError("sampler 'pc_sampler' has no token-frequency table: decode through dllm.generate (which "
                            f"reads {FREQUENCY_FILE} from the model's directory) or set frequency_file")
        frequency = getattr(ctx.state, "frequency", None)
        if frequency is None:
            frequency = ctx.state.frequency = dense_frequencies(*self._table, ctx.logits.shape[-1], ctx.logits.device)
        tokens = gumbel_argmax(ctx.logits, self.temperature, ctx.generators)
        confidence = ctx.logits.softmax(-1).gather(-1, tokens[..., None])[..., 0]  # in the logits' dtype
        calibrated = -confidence * torch.log(frequency[tokens] + 1e-9)
        calibrated = calibrated.clamp(max=per_row(self.clip, calibrated))
        k = (ctx.positions - ctx.block_start).float()
        score = torch.exp(-per_row(self.position_decay, calibrated) * k) * calibrated
        return Commit(topk_commits(score, ctx.eligible, quota(ctx)), tokens, score)


def topk_commits(score: Tensor, eligible: Tensor, count: Tensor) -> Tensor:
    """`[B, C]`: `torch.topk` of each row's scores over its eligible positions (-inf elsewhere), `count[b]` of
    them, as the authors select: among equal scores torch's order decides (on a CPU not always the lowest
    position), and a row's scores are the block's alone or in a batch."""
    score = score.masked_fill(~eligible, float("-inf"))
    mask = torch.zeros_like(eligible)
    for b, k in enumerate(count.tolist()):
        if k:
            mask[b, torch.topk(score[b], k).indices] = True
    return mask


def read_table(path: Path) -> tuple[Tensor, Tensor, int]:
    """A token-frequency JSON: ours ({"total", "counts"}) or the PC-Sampler authors' ({"num_token",
    "p_baseline_dict"}); the listed ids, their counts and the total."""
    fix = ('give {"total": N, "counts": {"token id": count}} (or the PC-Sampler authors\' num_token and '
           f'p_baseline_dict); {COUNT_COMMAND} writes one')
    data = read_json(path, fix)
    total, counts = (data.get("total"), data.get("counts")) if "counts" in data else \
        (data.get("num_token"), data.get("p_baseline_dict"))
    if isinstance(total, bool) or not isinstance(total, int) or total < 1 or not isinstance(counts, dict):
        raise DllmError(f"{path} is no token-frequency table; {fix}")
    try:
        ids = [int(i) for i in counts]
    except ValueError:
        raise DllmError(f"{path} lists a token that is no integer id; {fix}") from None
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts.values()) or \
            any(i < 0 for i in ids):
        raise DllmError(f"{path} holds a negative or non-integer count or id; {fix}")
    return torch.tensor(ids, dtype=torch.long), torch.tensor(list(counts.values()), dtype=torch.float64), total


def dense_frequencies(ids: Tensor, counts: Tensor, total: int, vocab: int, device) -> Tensor:
    """`[vocab]` float32 frequencies count / total, 1 / total for an unlisted token (the authors' `load_baseline`)."""
    if len(ids) and int(ids.max()) >= vocab:
        raise DllmError(f"the token-frequency table lists token id {int(ids.max())}, outside this model's vocabulary "
                        f"({vocab} tokens); count a table with this model's tokenizer")
    table = torch.full((vocab,), 1 / total, dtype=torch.float32)
    table[ids] = (counts / total).float()
    return table.to(device)
