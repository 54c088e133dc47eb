"""A trace file and the decoding order it shows: which step committed each answer position, and which steps took a
token back (a re-masking sampler such as WINO), the figure papers print as position against step.

A trace file holds one or more decodes, each a `{"decode": ...}` line (sampler, cache, forwards, tokens per forward,
the mask id and each row's answer span on the canvas) followed by its steps' lines (`stats.trace_step`).
`dllm generate --trace` writes one decode, `dllm eval --trace` one per batch (its rows carry the examples' ids)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import DllmError


def decode_header(generation, mask_id: int | None, ids: list[str] | None = None) -> dict:
    """The `{"decode": ...}` line before a `Generation`'s steps (`mask_id`: the model's, None on a uniform-state
    model); `ids` names its rows (eval's examples)."""
    stats = generation.stats
    rows = [{"answer_start": a, "answer_end": b} for a, b in generation.answer_spans]
    for row, name in zip(rows, ids or []):
        row["id"] = name
    return {"decode": {"sampler": generation.sampler, "cache": generation.cache, "forwards": stats.nfe,
                       "tpf": stats.tpf, "gen_tokens": stats.gen_tokens, "mask_id": mask_id,
                       "rows": rows}}


def trace_lines(generation, mask_id: int | None, ids: list[str] | None = None) -> str:
    """A decode as a trace file's lines: its header, then a line per step."""
    return "".join(json.dumps(record) + "\n" for record in [decode_header(generation, mask_id, ids),
                                                             *generation.trace])


@dataclass
class RowOrder:
    """One answer's decoding order: positions counted from the answer's first, steps from 1 (the decode's steps in
    order, blocks included)."""

    sampler: str
    cache: str
    forwards: int  # of the decode the row was in (a batch's forwards serve all its rows)
    tpf: float
    length: int  # answer positions
    id: str | None = None
    committed: dict[int, int] = field(default_factory=dict)  # position -> the step that committed its final token
    taken_back: list[tuple[int, int]] = field(default_factory=list)  # (position, step) re-masked
    rewritten: list[tuple[int, int]] = field(default_factory=list)  # (position, step) a decoded token replaced

    @property
    def title(self) -> str:
        return f"{self.sampler} · cache {self.cache} · {self.forwards} forwards · {self.tpf:.2f} tokens/forward"


def read_trace(path: str | Path) -> list[RowOrder]:
    """Every row of every decode in a trace file, in order, with its decoding order."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise DllmError(f"cannot read trace {path}: {e.strerror}; give a file written by --trace") from None
    rows: list[RowOrder] = []
    decode, steps = None, []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise DllmError(f"{path} line {number} is not JSON; give a file written by --trace") from None
        if "decode" in record:
            if decode is not None:
                rows += decoding_order(decode, steps)
            decode, steps = record["decode"], []
        elif decode is None:
            raise DllmError(f"{path} starts without a decode line (written before dllm wrote one); write it again "
                            f"with --trace")
        else:
            steps.append(record)
    if decode is None:
        raise DllmError(f"{path} holds no decode; give a file written by --trace")
    return rows + decoding_order(decode, steps)


def decoding_order(decode: dict, steps: list[dict]) -> list[RowOrder]:
    """Each row's order from a decode's header and its step records: a commit sets the position's step (a later
    commit after a re-mask replaces it), an edit to the mask token is a take-back, another edit a rewrite."""
    rows = [RowOrder(decode["sampler"]["name"], decode["cache"]["name"], decode["forwards"], decode["tpf"],
                     r["answer_end"] - r["answer_start"], r.get("id")) for r in decode["rows"]]
    starts = [r["answer_start"] for r in decode["rows"]]
    for number, record in enumerate(steps, 1):
        for b, row in enumerate(rows):
            for c in record["commits"][b]:
                if 0 <= c["position"] - starts[b] < row.length:
                    row.committed[c["position"] - starts[b]] = number
            for e in record.get("edits", [[]] * len(rows))[b]:
                at = e["position"] - starts[b]
                if 0 <= at < row.length:
                    if e["token"] == decode["mask_id"]:
                        row.taken_back.append((at, number))
                        row.committed.pop(at, None)
                    else:
                        row.rewritten.append((at, number))
    return rows


def plot_orders(columns: list[list[RowOrder]], names: list[str], path: str | Path) -> None:
    """The figure: a column per trace file (`names`), a panel per row, answer position across and the step that
    committed it down, one colour per step; re-masked tokens as red crosses at the step that took them back,
    rewritten ones as black rings."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise DllmError("dllm trace plot draws with matplotlib; pip install 'dllm-fast[plot]'") from None
    height = max(map(len, columns))
    fig, axes = plt.subplots(height, len(columns), figsize=(5.5 * len(columns), 3.2 * height), squeeze=False)
    for c, (rows, name) in enumerate(zip(columns, names)):
        for r in range(height):
            ax = axes[r][c]
            if r >= len(rows):
                ax.axis("off")
                continue
            row = rows[r]
            last = max([*row.committed.values(), *(s for _, s in row.taken_back), 1])
            positions = sorted(row.committed)
            ax.scatter(positions, [row.committed[p] for p in positions], c=[row.committed[p] for p in positions],
                       cmap="viridis", vmin=1, vmax=last, marker="s", s=18)
            if row.taken_back:
                ax.scatter(*zip(*row.taken_back), color="tab:red", marker="x", s=22, label="taken back (re-masked)")
            if row.rewritten:
                ax.scatter(*zip(*row.rewritten), facecolors="none", edgecolors="black", s=26, label="rewritten")
            if row.taken_back or row.rewritten:
                ax.legend(fontsize=7, loc="lower right")
            ax.set_xlim(-1, row.length)
            ax.set_ylim(last + 1, 0)  # step 1 on top: the canvas fills downwards
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlabel("answer position")
            ax.set_ylabel("step")
            label = f"{name}, row {r}" if row.id is None else f"{name}, {row.id}"
            ax.set_title(f"{label}\n{row.title}", fontsize=9)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except ValueError as e:  # a format matplotlib does not write
        raise DllmError(f"cannot write {path}: {e}; name a .png, .svg or .pdf file") from None
    finally:
        plt.close(fig)
