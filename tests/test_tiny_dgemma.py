"""The shipped tiny-dgemma: a uniform-state DiffusionGemma (`scripts/train_tiny.py --arch dgemma`) that loads by
name with its family's decoding (entropy_bound, one 48-token canvas per answer, the block cache) and gives its
recorded answers; a padded row gives the answer of its prompt alone. Its accuracy is in RESULTS.md."""
import pytest

import dllm
from dllm.engine.options import decoding_lengths, family_decoding
from dllm.eval.synthetic import make_split
from dllm.models.loading import model_families

HELD_OUT = [ex.prompt for ex in make_split("test", 2)]  # two held-out items of every family
# every one right, the worked sums too (RESULTS.md: 99.3% held out)
GOLDEN = ["#### 9jdivkj", "#### o81njodua", "#### fywmcz", "#### o7ilp6pnu", "#### 05,06,12,17,22,25,84,87",
          "#### 11,15,16,20,20,24,39,71", "000000000 #### 0", "00000012 #### 2",
          "2+1+0=03 6+1+0=07 0+1+0=01 0+8+0=08 #### 8173", "3+6+0=09 3+4+0=07 0+2+0=02 0+2+0=02 #### 2279"]


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


def test_it_gives_its_recorded_answers(tiny):
    assert dllm.generate(*tiny, HELD_OUT).texts == GOLDEN


def test_a_padded_row_gives_its_answer_alone(tiny):
    alone = [dllm.generate(*tiny, [prompt]).token_ids[0] for prompt in HELD_OUT[::2]]
    assert dllm.generate(*tiny, HELD_OUT[::2]).token_ids == alone
