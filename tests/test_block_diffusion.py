"""Block-diffusion models (issue #20, first part): SDAR's network equals transformers' Qwen3 under a block-causal
mask, its name table covers the released checkpoint, the exact block cache equals recomputing everything, and a
batch row equals its prompt alone."""
import json

import pytest
import torch
from conftest import random_model, shared_path
from test_models import _randomize, _write_checkpoint
from transformers import Qwen3Config, Qwen3ForCausalLM

import dllm
from dllm import cache as caches
from dllm import samplers
from dllm.core.errors import DllmError
from dllm.engine import Batch, decode
from dllm.models import PRESETS, DiffusionLM, sdar
from dllm.models.checkpoint import table_names
from dllm.models.loading import load_weights

BLOCK = 4
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19, 20, 21, 22]]  # 7, 3, 8 tokens: every
# remainder mod 4, so the first answer block holds a prompt tail or not


def block_causal(length: int, block: int = BLOCK) -> torch.Tensor:
    blocks = torch.arange(length) // block
    return blocks[None, :] <= blocks[:, None]


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def reference(tmp_path_factory, request):
    """transformers' Qwen3 with random weights and our SDAR loaded from the same checkpoint; tied: the head is the
    embedding matrix and the checkpoint has no lm_head (SDAR-1.7B, as Qwen3-1.7B)."""
    tied = request.param
    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e6,
                      tie_word_embeddings=tied, attention_bias=False, attn_implementation="sdpa")
    ref = Qwen3ForCausalLM(cfg)
    _randomize(ref)
    hf = {**sdar.hf_config(PRESETS["sdar-tiny"]), "tie_word_embeddings": tied}
    state = {k: v for k, v in ref.state_dict().items() if not (tied and k == "lm_head.weight")}
    path = tmp_path_factory.mktemp("sdar")
    _write_checkpoint(path, hf, state)
    model = DiffusionLM(sdar.config_from_hf(hf))
    load_weights(model, path, sdar.WEIGHT_NAMES)
    return ref.eval(), model.eval()


def test_sdar_logits_equal_qwen3_under_a_block_causal_mask(reference):
    ref, model = reference
    ids = torch.randint(0, 120, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = block_causal(12)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask[None, None].expand(2, 1, 12, 12)).logits
        bidirectional = ref(input_ids=ids, attention_mask=torch.ones(2, 1, 12, 12, dtype=torch.bool)).logits
        got = model(ids)
    assert (got - want).abs().max() < 1e-4
    assert (want - bidirectional).abs().max() > 1e-2  # the block mask took effect


def test_sdar_left_padding_matches_qwen3(reference):
    ref, model = reference
    ids = torch.randint(0, 120, (2, 11), generator=torch.Generator().manual_seed(2))
    real = torch.ones(2, 11, dtype=torch.bool)
    real[0, :3] = False
    positions = (real.long().cumsum(1) - 1).clamp(min=0)
    blocks = positions // BLOCK
    mask = (blocks[:, None, :] <= blocks[:, :, None]) & real[:, None, :]
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask[:, None], position_ids=positions).logits
        got = model(ids, attention_mask=real)
    assert (got[real] - want[real]).abs().max() < 1e-4


def test_name_table_covers_the_released_sdar_checkpoint():
    index = json.loads(shared_path("data/sdar-4b-chat/model.safetensors.index.json").read_text())["weight_map"]
    hf = json.loads(shared_path("data/sdar-4b-chat/config.json").read_text())
    cfg = sdar.config_from_hf(hf, end_of_turn_id=151645)
    with torch.device("meta"):
        names = table_names(DiffusionLM(cfg), sdar.WEIGHT_NAMES)
    assert set(names) == set(index)  # 399 names, each way
    assert cfg == PRESETS["sdar-4b"] and cfg.block_size == 4 and cfg.head_dim == 128


@pytest.fixture(scope="module")
def model():
    return dllm.load("random:sdar-tiny", seed=1)[0]


def run(model, prompts, sampler="threshold", cache="none", gen=16, **args):
    return decode(model, prompts, samplers.SAMPLERS.create(sampler, **args), caches.CACHES.create(cache), gen, BLOCK)


@pytest.mark.parametrize("sampler,args", [("threshold", {"threshold": 0.3}), ("low_confidence", {}),
                                          ("low_confidence_dynamic", {"threshold": 0.3}), ("credit", {})])
def test_exact_block_cache_equals_recomputing_everything(model, sampler, args):
    want, want_stats, _ = run(model, PROMPTS, sampler, "none", **args)
    for cache in ("block", "dual", "prefix"):  # under a block-causal mask every block cache is exact
        got, stats, _ = run(model, PROMPTS, sampler, cache, **args)
        assert torch.equal(got.tokens, want.tokens), cache
        assert stats.nfe == want_stats.nfe
    _, block, _ = run(model, PROMPTS, sampler, "block", **args)
    assert block.rows_per_layer[0] < want_stats.rows_per_layer[0] / 3


def test_later_blocks_never_change_earlier_logits(model):
    """The mask is block-causal: rewriting the tokens of blocks after b leaves every logit up to b alone."""
    ids = torch.randint(0, 120, (1, 16), generator=torch.Generator().manual_seed(3))
    changed = ids.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 120
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert torch.equal(a[:, :8], b[:, :8]) and not torch.equal(a[:, 8:], b[:, 8:])


def test_answer_blocks_are_the_model_blocks(model):
    """As SDAR's reference: the first answer block is the attention block the prompt ends in (its tail kept),
    the answer runs to the end of a block, and each row equals its prompt alone."""
    canvas, _, _ = run(model, PROMPTS, "low_confidence", "block")
    for row, prompt in enumerate(PROMPTS):
        start, end = int(canvas.gen_start[row]), int(canvas.gen_end[row])
        pad = start - len(prompt)
        assert end - pad == -(-(len(prompt) + 16) // BLOCK) * BLOCK  # positions 0 .. the end of a whole block
        assert canvas.tokens[row, pad:start].tolist() == prompt
        alone, _, _ = run(model, [prompt], "low_confidence", "block")
        assert torch.equal(canvas.tokens[row, start:end], alone.tokens[0, alone.prompt_length:])


def test_rows_joining_between_blocks_equal_alone(model):
    s, c = samplers.SAMPLERS.create("threshold", threshold=0.3), caches.CACHES.create("block")
    batch = Batch(model, s, c, BLOCK, BLOCK)
    first = batch.add(PROMPTS[0], 12)
    batch.run_block()
    second = batch.add(PROMPTS[1], 8)
    while batch.running:
        batch.run_block()
    for row, prompt, gen in ((first, PROMPTS[0], 12), (second, PROMPTS[1], 8)):
        alone, _, _ = decode(model, [prompt], s, caches.CACHES.create("block"), gen, BLOCK)
        answer = alone.tokens[0, alone.prompt_length:].tolist()
        stops = model.config.stop_ids
        assert batch.answer(row) == answer[:next((i for i, t in enumerate(answer) if t in stops), len(answer))]


@pytest.mark.parametrize("cache", ["dkv", "elastic"])
def test_full_attention_caches_refuse_block_causal_models(model, cache):
    with pytest.raises(DllmError, match=r"chooses rows for full attention; on a block-causal model \(sdar\) use "
                                        r"cache block \(exact\)"):
        run(model, PROMPTS, "low_confidence", cache)


def test_prophet_is_refused_on_block_causal_models(model):
    """Prophet's early exit fills later blocks from a forward in which they follow masked blocks, which a
    block-causal model never saw in training (on tiny-sdar it wrote `#### 321#l eh` for `321olleh`)."""
    with pytest.raises(DllmError, match=r"sampler 'prophet' commits later blocks from one forward, which a "
                                        r"block-causal model \(sdar\) predicts only from finished blocks"):
        run(model, PROMPTS, "prophet", "block")


def test_block_layout_errors(model):
    from dllm.engine.options import decoding_lengths
    with pytest.raises(DllmError, match=r"gen_length \(6\) must be a multiple of the model's attention block "
                                        r"\(4\); e.g. gen_length 8$"):
        decoding_lengths(model, 6)
    with pytest.raises(DllmError, match=r"block_length \(8\) must equal the model's attention block \(4\)"):
        decode(model, PROMPTS, samplers.SAMPLERS.create("threshold"), caches.CACHES.create("block"), 16, 8)
    llada = dllm.load("random:llada-tiny")[0]
    with pytest.raises(DllmError, match="cache 'block' is exact only under block-causal attention"):
        run(llada, PROMPTS, "threshold", "block")


def test_generate_and_serve_default_to_the_models_block_and_the_block_cache(capsys):
    """No --block-length: a block-causal model decodes in its own attention blocks, and with no --cache through
    its exact block cache (the tokens of recomputing everything, fewer rows), through the Python API, the CLI and
    the server alike (a served answer equals generate's)."""
    pytest.importorskip("fastapi")
    from dllm.cli import build_parser, main
    from dllm.cli.serving import serve_setup
    from dllm.serve import EngineClient, EngineSpec, LocalServer, post

    model, tok = dllm.load("random:sdar-tiny")
    want = dllm.generate(model, tok, "abc", chat=False)
    recomputed = dllm.generate(model, tok, "abc", cache="none", chat=False)
    assert want.cache["name"] == "block" and want.token_ids == recomputed.token_ids
    assert want.stats.rows_per_layer[0] < recomputed.stats.rows_per_layer[0]
    assert main(["generate", "--model", "random:sdar-tiny", "--no-chat", "abc", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["cache"]["name"] == "block" and printed["outputs"][0]["token_ids"] == want.token_ids[0]
    for verb in (["eval", "--limit", "2"], ["bench", "--gen-length", "8", "--repeats", "1"]):
        assert main([*verb, "--model", "random:sdar-tiny", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["config"]["cache"]["name"] == "block", verb
    _, _, defaults = serve_setup(build_parser().parse_args(["serve", "--model", "random:sdar-tiny"]))
    assert defaults["cache"] == "block"
    with LocalServer(EngineClient.spawn(EngineSpec("random:sdar-tiny"), defaults)) as local:
        status, answer = post(local.url + "/v1/completions", {"prompt": "abc"})
    assert status == 200 and answer["choices"][0]["text"] == want.texts[0]
    assert answer["usage"]["completion_tokens"] == len(want.token_ids[0])
    assert dllm.generate(*dllm.load("random:llada-tiny"), "abc", chat=False).cache["name"] == "none"


class _Recorded(samplers.SAMPLERS.get("joint_threshold")):
    """joint_threshold that records, before each step, the canvas and the block it decodes."""

    def step(self, ctx):
        self.seen.append((ctx.canvas.clone(), ctx.block_start, ctx.block_end))
        return super().step(ctx)


@pytest.mark.parametrize("preset", ["sdar-tiny", "llada2-tiny"])
def test_token_editing_touches_only_the_current_blocks_answer(preset):
    """LLaDA2.1's token editing rewrites decoded answer tokens of the current block (it does here: edits
    happen), never the prompt, its tail in the first block, or a finished block; the exact block cache still
    equals recomputing everything, and a batch row equals its prompt alone."""
    model = random_model(preset, seed=1)  # sharp logits: some argmaxes move as the block fills
    block = model.config.block_size

    def run(prompts, cache, recorded=None):
        s = recorded or samplers.SAMPLERS.create("joint_threshold", threshold=0.5, edit_threshold=0.3)
        return decode(model, prompts, s, caches.CACHES.create(cache), 16, block)

    recorded = _Recorded(threshold=0.5, edit_threshold=0.3)
    recorded.seen = []
    canvas, _, _ = run(PROMPTS, "block", recorded)
    steps = [*recorded.seen, (canvas.tokens, None, None)]
    edits = 0
    for (before, start, end), (after, _, _) in zip(steps, steps[1:]):
        changed = (before != after) & (before != model.config.mask_id)  # decoded tokens rewritten
        column = torch.arange(before.shape[1])[None]
        assert not (changed & ((column < start) | (column >= end) | (column < canvas.gen_start[:, None]))).any()
        edits += int(changed.sum())
    assert edits > 0
    want, _, _ = run(PROMPTS, "none")
    assert torch.equal(canvas.tokens, want.tokens)
    for row, prompt in enumerate(PROMPTS):
        alone, _, _ = run([prompt], "block")
        start, end = int(canvas.gen_start[row]), int(canvas.gen_end[row])
        assert torch.equal(canvas.tokens[row, start:end], alone.tokens[0, alone.prompt_length:])


def test_token_editing_that_never_edits_equals_threshold_decoding(model):
    """edit_threshold above 1 and no extra steps: joint_threshold is the threshold rule, step for step."""
    want, want_stats, _ = run(model, PROMPTS, "threshold", "block", threshold=0.3)
    got, stats, _ = run(model, PROMPTS, "joint_threshold", "block", threshold=0.3, edit_threshold=1.5,
                        edit_steps=0)
    assert torch.equal(got.tokens, want.tokens) and stats.nfe == want_stats.nfe


def test_token_editing_refuses_caches_that_keep_decoded_keys():
    llada = dllm.load("random:llada-tiny")[0]
    with pytest.raises(DllmError, match="sampler 'joint_threshold' rewrites decoded tokens, whose keys and values "
                                        "cache 'dkv' keeps; use cache none, prefix, dual"):
        decode(llada, PROMPTS, samplers.SAMPLERS.create("joint_threshold"), caches.CACHES.create("dkv"), 16, 8)
