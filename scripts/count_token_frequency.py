"""Count a model's token-frequency table for PC-Sampler (`samplers/pc_sampler.py`): how often each token id occurs
in a reference corpus tokenized with the model's tokenizer (no special tokens), written beside the checkpoint as
token_frequency.json, {"total": N, "counts": {"token id": count}, "corpus": "..."}. Deterministic.

    python scripts/count_token_frequency.py tiny-llada tiny-dream          # the shipped tables
    python scripts/count_token_frequency.py tiny-llada-lists --families \
        copy_list,reverse_list,sort_list,shuffle,replace_random,replace_index,insert_random,remove_random
    python scripts/count_token_frequency.py /path/to/LLaDA-8B-Instruct --corpus corpus.jsonl --fields text

Default corpus: the shipped tiny models' training data, the synthetic suite's training split as
scripts/train_tiny.py builds it (`make_split("train", 40000)`, README's commands), each example's prompt and answer
text. A JSONL corpus: the string fields `--fields` of every line. (The PC-Sampler authors counted theirs the same
way, `utils/calculate_p_baseline.py`; their files for LLaDA-8B and Dream-7B are read as they are: set
frequency_file, or copy one to the checkpoint as token_frequency.json.)
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from dllm.eval.synthetic import make_split
from dllm.models.checkpoint import load_tokenizer
from dllm.models.loading import SHIPPED_DIR, read_config, shipped_models
from dllm.samplers.pc_sampler import FREQUENCY_FILE


def corpus_texts(corpus: Path | None, fields: list[str], per_family: int, families: list[str] | None = None
                 ) -> tuple[list[str], str]:
    """The texts to count and a line that says what they are."""
    if corpus is None:
        examples = make_split("train", per_family, families=families)
        named = f", families={families}" if families else ""
        return ([text for ex in examples for text in (ex.prompt, ex.answer)],
                f"eval/synthetic.py make_split('train', {per_family}{named}): every example's prompt and answer")
    texts = []
    with corpus.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                texts += [row[key] for key in fields if isinstance(row.get(key), str)]
    return texts, f"{corpus.name}: fields {', '.join(fields)}"


def count(tokenizer, texts: list[str]) -> Counter:
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return Counter(i for row in ids for i in row)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="shipped model names or checkpoint directories")
    ap.add_argument("--corpus", type=Path, default=None, help="JSONL corpus (default: the synthetic training split)")
    ap.add_argument("--fields", default="text", help="comma-separated string fields of a JSONL corpus")
    ap.add_argument("--per-family", type=int, default=40000, help="synthetic examples per family")
    ap.add_argument("--families", default=None,
                    help="comma-separated synthetic families (default: the suite's; tiny-llada-lists: its list ones)")
    args = ap.parse_args(argv)
    texts, described = corpus_texts(args.corpus, args.fields.split(","), args.per_family,
                                    args.families.split(",") if args.families else None)
    for model in args.models:
        path = SHIPPED_DIR / model if model in shipped_models() else Path(model)
        counts = count(load_tokenizer(path, read_config(path)[1]), texts)
        table = {"total": sum(counts.values()), "counts": {str(i): counts[i] for i in sorted(counts)},
                 "corpus": described}
        (path / FREQUENCY_FILE).write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
        print(f"{path / FREQUENCY_FILE}: {len(counts)} tokens, {table['total']} in all")


if __name__ == "__main__":
    main()
