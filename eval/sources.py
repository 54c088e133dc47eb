"""Benchmark records, local first: a file given with `--data`, the copy packaged in `eval/data/`, then the
Hugging Face hub through `datasets.load_dataset` (only when online)."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

from dllm.core.errors import DllmError

PACKAGED = Path(__file__).resolve().parent / "data"

# packaged file stem -> (hub dataset, configuration, split)
HUB = {
    "gsm8k-test": ("openai/gsm8k", "main", "test"),
    "gsm8k-train": ("openai/gsm8k", "main", "train"),
    "math500-test": ("HuggingFaceH4/MATH-500", None, "test"),
    "math-train": ("EleutherAI/hendrycks_math", "algebra", "train"),
    "humaneval-test": ("openai/openai_humaneval", None, "test"),
    "mbpp-test": ("google-research-datasets/mbpp", "sanitized", "test"),
    "mbpp-prompt": ("google-research-datasets/mbpp", "sanitized", "prompt"),
}


def read_records(path: str | Path) -> list[dict]:
    """Rows of a `.jsonl`, `.jsonl.gz` or `.json` (a list of objects) file."""
    path = Path(path)
    if not path.is_file():
        raise DllmError(f"data file {path} does not exist; pass --data a .jsonl, .jsonl.gz or .json file")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            if path.suffix == ".json":
                rows = json.load(f)
            else:
                rows = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as e:
        raise DllmError(f"cannot read {path} ({e}); pass --data a .jsonl, .jsonl.gz or .json file") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise DllmError(f"{path} must hold one JSON object per record; pass --data a file of the dataset's rows")
    return rows


def load(name: str, data: str | Path | None = None) -> tuple[list[dict], str]:
    """Rows of the packaged dataset `name` (e.g. "gsm8k-test") and where they came from."""
    if data is not None:
        return read_records(data), str(data)
    packaged = PACKAGED / f"{name}.jsonl.gz"
    if packaged.is_file():
        return read_records(packaged), f"packaged:{packaged.name}"
    hub_name, config, split = HUB[name]
    try:
        import datasets
        rows = [dict(r) for r in datasets.load_dataset(hub_name, config, split=split)]
    except Exception as e:  # offline, missing package, unknown dataset: all end the same way
        raise DllmError(f"no local copy of {name} and the hub failed ({type(e).__name__}); pass --data FILE") from None
    return rows, f"hub:{hub_name}"


def require_fields(rows: list[dict], fields: tuple[str, ...], source: str) -> None:
    """Every row has `fields`, or a one-line error naming the first missing one."""
    for i, row in enumerate(rows):
        missing = [f for f in fields if f not in row]
        if missing:
            raise DllmError(f"record {i} of {source} has no field {missing[0]!r}; the file needs the fields "
                            f"{', '.join(fields)}")
