"""The shipped tiny-dgemma: a uniform-state DiffusionGemma (`scripts/train_tiny.py --arch dgemma`) that loads by
name with its family's decoding (entropy_bound, one 48-token canvas per answer, the block cache) and answers its
held-out items right; a padded row gives the answer of its prompt alone. Its accuracy is in RESULTS.md."""
import pytest

import dllm
from dllm.engine.options import decoding_lengths, family_decoding
from dllm.eval.synthetic import make_split
from dllm.models.loading import model_families

ITEMS = make_split("test", 2)  # two held-out items of every family
HELD_OUT = [ex.prompt for ex in ITEMS]


@pytest.fixture(scope="module")
def tiny():
    return dllm.load("tiny-dgemma")


def test_it_loads_with_one_canvas_per_answer(tiny):
    model, _ = tiny
    cfg = model.config
    assert (cfg.arch, cfg.mask_id, cfg.canvas_length) == ("diffusion_gemma", None, 48)
    assert decoding_lengths(model) == {"gen_length": 48, "block_length": 48, "steps": 48}
    assert family_decoding(model)["sampler"] == "entropy_bound"
    assert model_families()["tiny-dgemma"] == "diffusion_gemma"


def test_it_answers_every_held_out_item_right(tiny):
    """Each answer is the item's reference, worked steps and sums included (RESULTS.md: 99.3% held out): not a
    recorded sample of a random canvas, whose tokens a CPU that rounds otherwise may change."""
    assert dllm.generate(*tiny, HELD_OUT).texts == [ex.answer for ex in ITEMS]


def test_a_padded_row_gives_its_answer_alone(tiny):
    alone = [dllm.generate(*tiny, [prompt]).token_ids[0] for prompt in HELD_OUT[::2]]
    assert dllm.generate(*tiny, HELD_OUT[::2]).token_ids == alone
