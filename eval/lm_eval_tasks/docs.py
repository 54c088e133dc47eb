"""The documents of the packaged lm-eval tasks: the synthetic suite's held-out split (`dllm.eval.synthetic`, families
interleaved as `dllm eval --task synthetic` orders them), built here, so nothing is downloaded. lm-eval calls these
through `custom_dataset` with the task's metadata as keywords."""
from __future__ import annotations

import datasets

from dllm.eval.tasks import get_task

CHOICES = 4  # the right answer and three others of the same family


def _items():
    return get_task("synthetic").load(None, 0)[0]


def generation(**metadata) -> dict[str, datasets.Dataset]:
    """prompt, the full answer, the final answer after `####` (the target) and the family."""
    rows = [{"prompt": it.prompt, "answer": it.gold, "target": it.reference, "family": it.group} for it in _items()]
    return {"test": datasets.Dataset.from_list(rows)}


def multiple_choice(**metadata) -> dict[str, datasets.Dataset]:
    """prompt, four whole answers (the wrong ones: the next other answers of the family) and the right one's place,
    which cycles so that no position wins by itself."""
    by_family: dict[str, list[str]] = {}
    for it in _items():
        by_family.setdefault(it.group, []).append(it.gold)
    rows = []
    for it in _items():
        family = by_family[it.group]
        k = family.index(it.gold)
        wrong = list(dict.fromkeys(a for a in family[k + 1:] + family[:k] if a != it.gold))[:CHOICES - 1]
        gold = k % CHOICES
        rows.append({"prompt": it.prompt, "choices": wrong[:gold] + [it.gold] + wrong[gold:], "gold": gold,
                     "family": it.group})
    return {"test": datasets.Dataset.from_list(rows)}
