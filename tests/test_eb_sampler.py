"""The entropy bound of EB-Sampler (arXiv 2505.24857) is shared (`samplers.base.entropy_bounded`) by SDAR's
`entropy_bounded` and DiffusionGemma's `entropy_bound`: they decode what they decoded before it was shared."""
import functools
import hashlib
import json

import pytest
from conftest import random_model

import dllm
from dllm import cache as caches
from dllm import samplers
from dllm.engine import decode

PROMPTS = ["reverse: abc12", "sort: 42,07,19,03", "add: 0457+0168", "copy: k3x9a"]


@functools.cache
def loaded(name: str):
    return dllm.load(name)


ROWS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19], [20, 21]]
# (model, sampler, parameters) -> sha1 of the final canvas's token ids (json), forwards: recorded on main at 340e613,
# before the bound was shared (entropy_bounded: gen 32, blocks of 16, no cache, seeds 1-4; on sdar-tiny gen 16 in its
# blocks of 4 with the block cache; entropy_bound: gen 32, canvases of 16, 24 steps, seeds 3 and 8)
GOLDEN = {
    ("llada-tiny", "entropy_bounded", (("bound", 12.0),)): ("21116b04513d", 12),
    ("llada-tiny", "entropy_bounded", (("bound", 8.0), ("temperature", 0.9))): ("09749439bc62", 17),
    ("dream-tiny", "entropy_bounded", (("bound", 6.0),)): ("f9a123c9612e", 32),
    ("dream-tiny", "entropy_bounded", (("bound", 12.0),)): ("29408670a123", 12),
    ("dream-tiny", "entropy_bounded", (("bound", 8.0), ("temperature", 0.9))): ("36cc7c8b23e6", 16),
    ("sdar-tiny", "entropy_bounded", (("bound", 0.35),)): ("162e1edbd671", 17),
    ("sdar-tiny", "entropy_bounded", (("bound", 9.0),)): ("98f391d8fa9d", 9),
    ("diffusion-gemma-tiny", "entropy_bound", (("bound", 0.1),)): ("fb69816e9e5a", 24),
    ("diffusion-gemma-tiny", "entropy_bound", (("bound", 1.0),)): ("760b9bef139d", 24),
    ("diffusion-gemma-tiny", "entropy_bound", (("bound", 20.0),)): ("5405516b3fd6", 24),
}


@pytest.mark.parametrize("case", list(GOLDEN), ids=lambda case: f"{case[0]}-{case[1]}-{dict(case[2])}")
def test_the_samplers_sharing_the_bound_decode_as_before(case):
    preset, name, params = case
    model, sampler = random_model(preset), samplers.SAMPLERS.create(name, **dict(params))
    if preset == "sdar-tiny":
        canvas, stats, _ = decode(model, ROWS[:2], sampler, caches.CACHES.create("block"), 16, 4)
    elif name == "entropy_bound":
        canvas, stats, _ = decode(model, ROWS[:2], sampler, caches.CACHES.create("none"), 32, 16, 24, seed=[3, 8])
    else:
        canvas, stats, _ = decode(model, ROWS, sampler, caches.CACHES.create("none"), 32, 16, seed=[1, 2, 3, 4],
                                  stop_early=False)
    digest = hashlib.sha1(json.dumps(canvas.tokens.tolist()).encode()).hexdigest()[:12]
    assert (digest, stats.nfe) == GOLDEN[case]


def test_the_shipped_models_decode_entropy_bounded_as_before():
    """tiny-llada, many positions a step (recorded on main at 340e613 with `dllm.generate`, chat prompts)."""
    model, tok = loaded("tiny-llada")
    out = dllm.generate(model, tok, PROMPTS, sampler="entropy_bounded", bound=0.35, temperature=0.8, gen_length=64,
                        block_length=16, seed=[1, 2, 3, 4], stop_early=False)
    digest = hashlib.sha1(json.dumps(out.token_ids).encode()).hexdigest()[:12]
    assert (digest, out.stats.nfe) == ("0698fa6ab967", 5)
