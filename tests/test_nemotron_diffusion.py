"""Nemotron-Labs-Diffusion (issue #37, second part): the backbone equals transformers' Ministral 3 (YaRN RoPE, the
per-position query scale) under the same masks, loaded from a `save_pretrained` directory through our loader with
the released names; decoding equals a transcription of NVIDIA's and vLLM's block loop (causal prefix, each block
of 32 all-mask and denoised bidirectionally) and of NVIDIA's causal_context loop (each block's first token the
causal next-token prediction; `causal_first`, this family's default) run on transformers' network; every exact
cache gives its tokens."""
import dataclasses
import json
import math

import pytest
import torch
from conftest import random_model
from safetensors.torch import load_file, save_file
from test_models import _randomize
from transformers import Ministral3Config, Ministral3ForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.ministral3.modeling_ministral3 import Ministral3RotaryEmbedding

import dllm
from dllm import cache as caches
from dllm import samplers
from dllm.core.errors import DllmError
from dllm.engine import decode
from dllm.models import PRESETS, DiffusionLM, nemotron_diffusion
from dllm.models.checkpoint import table_names
from dllm.models.rope_scaling import YaRN
from dllm.models.tokenizer import build_char_tokenizer, save_tokenizer
from dllm.models.transformer import rope_frequencies, visible_keys

MASK, EOS, PAD = 127, 125, 126
RELEASED_ROPE = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 16384,
                 "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                 "llama_4_scaling_beta": 0.1}
TINY_ROPE = {**RELEASED_ROPE, "original_max_position_embeddings": 8}  # the query scale grows from position 8
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]]


def ministral3_config(rope: dict) -> Ministral3Config:
    return Ministral3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                            rope_parameters=dict(rope), rms_norm_eps=1e-5, attn_implementation="sdpa",
                            pad_token_id=PAD, eos_token_id=EOS, bos_token_id=1)


@pytest.fixture(scope="module", params=["released", "no-mscale"])
def reference(tmp_path_factory, request):
    """transformers' Ministral 3 with random weights, saved with `save_pretrained`, renamed to the released
    Nemotron names (`model.` -> `encoder.`, `lm_head` -> `diffusion_head`) and loaded with `dllm.load`.
    no-mscale: YaRN's attention factor is 0.1 ln 16 + 1 (the released config's mscale pair makes it 1)."""
    rope = TINY_ROPE if request.param == "released" else {k: v for k, v in TINY_ROPE.items() if "mscale" not in k}
    ref = Ministral3ForCausalLM(ministral3_config(rope))
    _randomize(ref)
    hf_dir, path = tmp_path_factory.mktemp("ministral3"), tmp_path_factory.mktemp("nemotron")
    ref.save_pretrained(hf_dir)
    state = load_file(str(hf_dir / "model.safetensors"))
    renamed = {("diffusion_head." + k.removeprefix("lm_head.")) if k.startswith("lm_head.")
               else "encoder." + k.removeprefix("model."): v for k, v in state.items()}
    save_file(renamed, str(path / "model.safetensors"))
    hf = json.loads((hf_dir / "config.json").read_text())
    hf.update(architectures=["NemotronLabsDiffusionModel"], model_type="nemotron_labs_diffusion", block_size=32,
              mask_token_id=MASK, dlm_paradigm="bidirectional")
    (path / "config.json").write_text(json.dumps(hf))
    save_tokenizer(build_char_tokenizer("llada"), path)
    model, _ = dllm.load(str(path))
    return ref.eval(), model


def causal(length: int) -> torch.Tensor:
    return torch.ones(length, length, dtype=torch.bool).tril()


def test_backbone_equals_ministral3_under_a_causal_mask(reference):
    """Ministral 3 is causal; the same mask through our network gives its logits, the query scale included
    (positions from 8 on here): without the scale the first 8 positions agree and the later ones do not."""
    ref, model = reference
    ids = torch.randint(0, 120, (2, 40), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(40).expand(2, -1)
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = model.run(ids, positions, causal(40)[None, None])
    assert (got - want).abs().max() < 1e-4
    unscaled = DiffusionLM(dataclasses.replace(model.config, query_scale=None))
    unscaled.load_state_dict(model.state_dict())
    with torch.no_grad():
        plain = unscaled.run(ids, positions, causal(40)[None, None])
    assert torch.allclose(plain[:, :8], got[:, :8], atol=1e-5) and (plain[:, 8:] - got[:, 8:]).abs().max() > 1e-3


def test_denoising_mask_equals_ministral3_given_it(reference):
    """The decoding mask (`visible_keys` with a window): prefix causal, the window's rows see the whole prefix and
    window, nothing after it; left-padded rows keep their own positions. Equal to Ministral 3 given that 4D mask,
    and different from a fully bidirectional forward."""
    ref, model = reference
    ids = torch.randint(0, 120, (2, 44), generator=torch.Generator().manual_seed(2))
    real = torch.ones(2, 44, dtype=torch.bool)
    real[1, :5] = False  # row 1: 5 pad columns, then 39 tokens
    positions = (real.long().cumsum(1) - 1).clamp(min=0)
    lo, hi = 20, 36  # canvas columns being decoded; 36..43 come later
    window = (positions[:, lo], positions[:, hi - 1] + 1)
    mask = visible_keys(model.config, positions, positions, real[:, None, None, :], window)
    column = torch.arange(44)
    by_hand = (column[None, :] <= column[:, None]) | ((column[:, None] >= lo) & (column[:, None] < hi)
                                                      & (column[None, :] < hi))
    assert torch.equal(mask[:, 0][real], (by_hand[None] & real[:, None, :])[real])  # pad rows' queries: unused
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        got = model.run(ids, positions, mask)
        bidirectional = ref(input_ids=ids, attention_mask=real[:, None, None, :].expand(-1, 1, 44, -1),
                            position_ids=positions).logits
    assert (got[real] - want[real]).abs().max() < 1e-4
    assert (want[:, lo:hi] - bidirectional[:, lo:hi]).abs().max() > 1e-2


@pytest.mark.parametrize("rope", [RELEASED_ROPE, TINY_ROPE, {**RELEASED_ROPE, "original_max_position_embeddings": 4096,
                                                              "factor": 8.0, "mscale": None, "mscale_all_dim": None},
                                  {**RELEASED_ROPE, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False}],
                         ids=["released", "original-8", "original-4096-x8", "betas-untruncated"])
@pytest.mark.parametrize("head_dim", [16, 128])
def test_yarn_frequencies_equal_transformers(rope, head_dim):
    """YaRN's frequencies and attention factor as transformers computes them, and the RoPE tables of our network
    against Ministral 3's rotary embedding at the start, around the original length and near the 256k end."""
    rope = {k: v for k, v in rope.items() if v is not None}
    hf = ministral3_config(rope)
    hf.head_dim, hf.max_position_embeddings = head_dim, 262144
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    yarn = YaRN.from_hf(rope, 262144)
    assert torch.allclose(yarn.frequencies(1e6, head_dim), want, rtol=1e-6, atol=0)
    assert yarn.attention_factor == pytest.approx(factor, rel=1e-12)
    cfg = nemotron_diffusion.config_from_hf({**hf.to_dict(), "rope_parameters": rope, "mask_token_id": MASK})
    model = DiffusionLM(cfg)
    rotary = Ministral3RotaryEmbedding(hf)
    original = rope["original_max_position_embeddings"]
    for first in (0, original - 16, 262144 - 32):
        positions = torch.arange(first, first + 32)[None]
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
        ours_cos, ours_sin = model.rope_tables(positions)
        half = head_dim // 2  # our sin table carries rotate_half's sign
        angle = positions[..., None] * want.repeat(2)  # fp32 frequencies agree to an ulp, angles to that times pos
        tolerance = 1e-5 + angle * 2.4e-7
        assert ((ours_cos[:, 0] - cos).abs() <= tolerance).all()
        assert ((ours_sin[:, 0, :, half:] - sin[..., half:]).abs() <= tolerance[..., half:]).all()


def test_query_scale_beyond_the_original_length():
    """Queries (not keys) are scaled by 1 + 0.1 log(1 + floor(position / original)) after RoPE: 1 before the
    original length, 1 + 0.1 ln 2 from it, 1 + 0.1 ln 17 at 16 times it."""
    model = DiffusionLM(PRESETS["nemotron-diffusion-tiny"])  # original length 64
    positions = torch.tensor([[0, 63, 64, 127, 128, 1023]])
    cos, sin = model.rope_tables(positions)  # [1, 2, 6, R]: the keys' tables, then the queries'
    scale = 1 + 0.1 * torch.log(torch.tensor([1.0, 1.0, 2.0, 2.0, 3.0, 16.0]))[:, None]
    assert cos.shape[1] == 2 and scale[-1, 0] == pytest.approx(1 + 0.1 * math.log(1 + 1023 // 64))
    assert torch.allclose(cos[:, 1], cos[:, 0] * scale, rtol=1e-6) and torch.allclose(sin[:, 1], sin[:, 0] * scale,
                                                                                       rtol=1e-6)


def nvidia_block_loop(ref, prompt: list[int], gen: int, steps_per_block: int, rule: str, threshold: float = 0.0,
                      block: int = 32) -> list[int]:
    """NVIDIA's `generate_with_prefix_cache_block_diff` without `causal_context` but with its causal prefill and
    commit, which is vLLM's `MaskedDiffusionSampler` loop (PR 48279): blocks of `block` after the prompt, each
    all-mask, denoised over [causal prefix; block] at T = 0 by the even schedule k = ceil(masks / steps left):
    top-k by confidence (low_confidence), the first k masks (leftmost), or every mask with confidence >= threshold
    and always the best (threshold). The prefix is recomputed causally instead of cached (the same keys)."""
    x = list(prompt)
    for _ in range(gen // block):
        start = len(x)
        x += [MASK] * block
        for step in range(steps_per_block):
            masked = [i for i in range(start, len(x)) if x[i] == MASK]
            if not masked:
                break
            mask = causal(len(x))
            mask[start:] = True  # the block's rows see the prefix and the whole block
            with torch.no_grad():
                logits = ref(input_ids=torch.tensor([x]), attention_mask=mask[None, None]).logits[0].float()
            logits[:, MASK] = float("-inf")  # our samplers' convention (samplers/base.py)
            tokens = logits.argmax(-1)
            confidence = logits.softmax(-1).gather(-1, tokens[:, None])[:, 0]
            k = math.ceil(len(masked) / (steps_per_block - step))
            ranked = sorted(masked, key=lambda i: (-float(confidence[i]), i))
            chosen = {"leftmost": masked[:k], "low_confidence": ranked[:k],
                      "threshold": ranked[:1] + [i for i in ranked[1:] if confidence[i] >= threshold]}[rule]
            for i in chosen:
                x[i] = int(tokens[i])
    return x[len(prompt):]


@pytest.mark.parametrize("rule,steps,args", [("low_confidence", 64, {}), ("leftmost", 64, {}),
                                             ("leftmost", 16, {}), ("threshold", 64, {"threshold": 0.016})])
def test_decoding_equals_nvidia_block_loop_on_ministral3(reference, rule, steps, args):
    """Our loop (exact block cache, a left-padded batch) gives the reference loop's tokens for every prompt, and
    so does recomputing everything (cache none). Threshold 0.016 on these flat random logits commits several
    tokens per step (8 to 18 forwards for 64 tokens)."""
    ref, model = reference
    sampler = samplers.SAMPLERS.create(rule, **args)
    want = [nvidia_block_loop(ref, p, 64, steps // 2, rule, **args) for p in PROMPTS]
    for cache in ("block", "none"):
        canvas, _, _ = decode(model, PROMPTS, sampler, caches.CACHES.create(cache), 64, 32, steps, stop_early=False)
        got = [canvas.tokens[b, int(canvas.gen_start[b]):].tolist() for b in range(len(PROMPTS))]
        assert got == want, cache


def causal_next_token(ref, x: list[int]) -> int:
    """The argmax of the last row of a causal forward of `x` (NVIDIA's prefill and per-block commit forward)."""
    with torch.no_grad():
        logits = ref(input_ids=torch.tensor([x])).logits[0, -1].float()
    logits[MASK] = float("-inf")
    return int(logits.argmax())


def nvidia_causal_context_loop(ref, prompt: list[int], gen: int, steps_per_block: int, rule: str,
                               threshold: float = 0.0, block: int = 32) -> tuple[list[int], int]:
    """NVIDIA's `generate_with_prefix_cache_block_diff` with `causal_context=True` (what its `generate_diffusion`
    does by default), at T = 0: the prompt prefilled causally, its last row's argmax the first block's first
    token; each block that token and `block - 1` masks, denoised by at most `steps_per_block` forwards over
    [causal prefix; block], the block's rows bidirectional, committing per step k masks, k from the even schedule
    of the block's masks fixed at its start (`get_num_transfer_tokens`): the k most confident (low_confidence), the
    first k (leftmost: vLLM's rule, with NVIDIA's first token), or every mask with confidence >= threshold and
    always the best (threshold); then the finished block encoded causally, its last row's argmax the next block's
    first token. The prefix is recomputed causally instead of cached (the same keys). Returns the answer and the
    forwards run."""
    x, forwards = list(prompt), 1
    first = causal_next_token(ref, x)
    for _ in range(gen // block):
        start = len(x)
        x += [first] + [MASK] * (block - 1)
        share, larger = divmod(block - 1, steps_per_block)
        for k in [share + (i < larger) for i in range(steps_per_block)]:
            masked = [i for i in range(start, len(x)) if x[i] == MASK]
            if not masked:
                break
            mask = causal(len(x))
            mask[start:] = True  # the block's rows see the prefix and the whole block
            with torch.no_grad():
                logits = ref(input_ids=torch.tensor([x]), attention_mask=mask[None, None]).logits[0].float()
            forwards += 1
            logits[:, MASK] = float("-inf")
            tokens = logits.argmax(-1)
            confidence = logits.softmax(-1).gather(-1, tokens[:, None])[:, 0]
            ranked = sorted(masked, key=lambda i: (-float(confidence[i]), i))
            chosen = {"leftmost": masked[:k], "low_confidence": ranked[:k],
                      "threshold": ranked[:1] + [i for i in ranked[1:] if confidence[i] >= threshold]}[rule]
            for i in chosen:
                x[i] = int(tokens[i])
        first, forwards = causal_next_token(ref, x), forwards + 1
    return x[len(prompt):], forwards


@pytest.mark.parametrize("rule,steps,args", [("low_confidence", 64, {}), ("low_confidence", 16, {}),
                                             ("leftmost", 16, {}), ("threshold", 64, {"threshold": 0.016})],
                         ids=["low_confidence-32", "low_confidence-8", "leftmost-8", "threshold"])
def test_causal_first_equals_nvidia_causal_context_loop_on_ministral3(reference, rule, steps, args):
    """`causal_first`: every exact cache gives the reference loop's tokens for every prompt of a left-padded batch
    (each reference run alone), 32 and 8 steps per block of 32. The first step's forward reads the row before the
    block, computed causally (a causal next-token prediction), and on the block cache re-encodes the finished
    block causally: NVIDIA's commit forward, folded in, so a block costs the reference's forwards and the last
    block's commit is never run."""
    ref, model = reference
    sampler = samplers.SAMPLERS.create(rule, causal_first=True, **args)
    want = [nvidia_causal_context_loop(ref, p, 64, steps // 2, rule, **args) for p in PROMPTS]
    for cache in ("block", "none", "prefix", "dual"):
        canvas, stats, _ = decode(model, PROMPTS, sampler, caches.CACHES.create(cache), 64, 32, steps,
                                  stop_early=False)
        got = [canvas.tokens[b, int(canvas.gen_start[b]):].tolist() for b in range(len(PROMPTS))]
        assert got == [tokens for tokens, _ in want], cache
        if rule != "threshold":  # the schedule fixes every row's forwards
            assert stats.nfe == want[0][1] - 1 == 2 * (1 + min(steps // 2, 31))
    all_mask = [nvidia_block_loop(ref, p, 64, steps // 2, rule, **args) for p in PROMPTS]
    assert all_mask != [tokens for tokens, _ in want]


@pytest.mark.parametrize("rule", ["low_confidence", "threshold"])
def test_causal_first_sampled_rows_joining_between_blocks_equal_alone(tiny, rule):
    """With temperature, rows joining and leaving a running batch between blocks (every row's first step reads
    its own row before the block) give the tokens they give alone, on every cache fresh at a block start."""
    from test_batching import GEN, PROMPTS as JOINING, alone, staggered

    sampler = samplers.SAMPLERS.create(rule, causal_first=True, temperature=0.8)
    for cache in ("block", "none", "dual"):
        got, widest = staggered(tiny, sampler, caches.CACHES.create(cache))
        want = [alone(tiny, sampler, caches.CACHES.create(cache), p, g, seed=i)
                for i, (p, g) in enumerate(zip(JOINING, GEN))]
        assert widest >= 2 and got == want, cache


@pytest.mark.parametrize("preset,kind", [("llada-tiny", "llada"), ("sdar-tiny", "sdar")])
def test_causal_first_is_refused_on_a_model_without_a_causal_prefix(preset, kind):
    sampler = samplers.SAMPLERS.create("threshold", causal_first=True)
    with pytest.raises(DllmError, match=rf"^sampler 'threshold' cannot decode {kind}: causal_first reads the causal "
                                        r"next-token prediction .* causal-prefix model .*; drop causal_first$"):
        decode(random_model(preset), PROMPTS, sampler, caches.CACHES.create("none"), 32, 32)


def test_nemotron_decodes_with_the_causal_first_token_by_default(tiny, capsys):
    """NVIDIA's `generate_diffusion` defaults to causal_context=True: with no flags a Nemotron-Labs-Diffusion model
    decodes with `causal_first` through the API, the CLI and the server (the caller can turn it off); other
    families keep it off."""
    from dllm.cli import main

    model, tok = dllm.load("random:nemotron-diffusion-tiny")
    plain = dllm.generate(model, tok, "abc", chat=False)
    explicit = dllm.generate(model, tok, "abc", chat=False, causal_first=True)
    off = dllm.generate(model, tok, "abc", chat=False, causal_first=False)
    assert plain.sampler["causal_first"] and not off.sampler["causal_first"]
    assert plain.token_ids == explicit.token_ids != off.token_ids
    assert main(["generate", "--model", "random:nemotron-diffusion-tiny", "--no-chat", "abc", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["sampler"]["causal_first"] and printed["outputs"][0]["token_ids"] == plain.token_ids[0]
    assert main(["generate", "--model", "random:nemotron-diffusion-tiny", "--no-chat", "abc", "--json",
                 "--sampler-arg", "causal_first=false"]) == 0
    assert json.loads(capsys.readouterr().out)["outputs"][0]["token_ids"] == off.token_ids[0]
    from dllm.serve.requests import RequestReader

    served = RequestReader(model, tok, "nemotron", {"sampler": "threshold", "cache": "block", "sampler_args": {},
                                                    "cache_args": {}, "seed": 0})
    assert served.job({"prompt": "abc"}, chat=False).sampler.causal_first
    assert not served.job({"prompt": "abc", "causal_first": False}, chat=False).sampler.causal_first
    llada, llada_tok = dllm.load("random:llada-tiny")
    assert not dllm.generate(llada, llada_tok, "abc", chat=False, gen_length=32).sampler["causal_first"]


@pytest.fixture(scope="module")
def tiny():
    return random_model("nemotron-diffusion-tiny", seed=1)


@pytest.mark.parametrize("sampler,args", [("threshold", {"threshold": 0.3}), ("low_confidence", {}),
                                          ("leftmost", {}), ("speculative", {}),
                                          ("threshold", {"threshold": 0.3, "causal_first": True}),
                                          ("low_confidence", {"causal_first": True})])
def test_every_exact_cache_gives_the_same_tokens(tiny, sampler, args):
    def run(cache):
        return decode(tiny, PROMPTS, samplers.SAMPLERS.create(sampler, **args), caches.CACHES.create(cache), 64, 32)

    want, want_stats, _ = run("none")
    for cache in ("block", "prefix", "dual"):
        got, stats, _ = run(cache)
        assert torch.equal(got.tokens, want.tokens), cache
        assert stats.nfe == want_stats.nfe
    _, block, _ = run("block")
    assert block.rows_per_layer[0] < want_stats.rows_per_layer[0] / 2


def test_leftmost_commits_the_first_scheduled_masks():
    """vLLM's `selection_policy=leftmost`: the first k masked positions of the block, k = ceil(masks / steps
    left), whatever their confidence; tokens drawn as low_confidence draws them."""
    logits = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))
    logits[0, 7, 3] = 50.0  # by far the most confident position: still not before the left ones
    eligible = torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1], [0, 0, 0, 1, 0, 1, 1, 0]], dtype=torch.bool)
    ctx = samplers.StepContext(logits=logits, eligible=eligible, masked=eligible, positions=torch.arange(8),
                               canvas=torch.zeros(2, 8, dtype=torch.long), step=1, steps=4, block=0,
                               generators=[None, None], nfe=0, total_steps=4, block_start=0, block_end=8,
                               prompt_length=0, state=None)
    out = samplers.SAMPLERS.create("leftmost").step(ctx)
    k = (eligible.sum(1) + 2) // 3  # ceil(masks / 3 steps left): 3, 1
    first = eligible & (eligible.long().cumsum(1) <= k[:, None])
    assert torch.equal(out.mask, first) and torch.equal(out.tokens, logits.argmax(-1))


def test_name_table_covers_the_released_names_and_the_8b_config():
    """The released 8B config.json (as the spec and a model-card walkthrough quote it: second-hand) reads as our
    preset, and the name table covers its checkpoint's names (`encoder.*`, `diffusion_head.weight`)."""
    hf = {"architectures": ["NemotronLabsDiffusionModel"], "model_type": "nemotron_labs_diffusion",
          "attention_bias": False, "block_size": 32, "bos_token_id": 1, "dlm_paradigm": "bidirectional",
          "eos_token_id": 11, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
          "intermediate_size": 14336, "mask_token_id": 100, "max_position_embeddings": 262144, "mlp_bias": False,
          "num_attention_heads": 32, "num_hidden_layers": 34, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
          "rope_parameters": RELEASED_ROPE, "tie_word_embeddings": False, "vocab_size": 131072}
    cfg = nemotron_diffusion.config_from_hf(hf)
    assert cfg == PRESETS["nemotron-diffusion-8b"]
    layer = [f"encoder.layers.{{i}}.{name}.weight" for name in (
        "input_layernorm", "post_attention_layernorm", *(f"self_attn.{p}_proj" for p in "qkvo"),
        *(f"mlp.{p}_proj" for p in ("gate", "up", "down")))]
    released = {"encoder.embed_tokens.weight", "encoder.norm.weight", "diffusion_head.weight",
                *(name.format(i=i) for i in range(34) for name in layer)}
    with torch.device("meta"):
        assert set(table_names(DiffusionLM(cfg), nemotron_diffusion.WEIGHT_NAMES)) == released
    assert 8.4e9 < cfg.num_parameters() < 8.6e9  # untied head: two 537M vocabulary matrices


@pytest.mark.parametrize("field,value", [("dlm_type", "dream"), ("sliding_window", 4096), ("mlp_bias", True),
                                         ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6})])
def test_configs_of_another_network_are_refused(tmp_path, field, value):
    model, tok = dllm.load("random:nemotron-diffusion-tiny")
    dllm.save_pretrained(model, tok, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, field: value}))
    with pytest.raises(DllmError, match=r"config.json: config.json has (\w+=|RoPE type)"):
        dllm.load(str(tmp_path))


def test_saved_and_loaded_again_equal(tmp_path, tiny):
    dllm.save_pretrained(tiny, build_char_tokenizer("llada"), tmp_path)
    again, _ = dllm.load(str(tmp_path))
    assert again.config == tiny.config
    ids = torch.randint(0, 120, (1, 80), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(again(ids), tiny(ids))


def test_cli_lists_the_family_and_generates_with_the_block_cache(capsys):
    from dllm.cli import main

    assert main(["list", "models", "--json"]) == 0
    families = {e["name"]: e["family"] for e in json.loads(capsys.readouterr().out)}
    assert families["random:nemotron-diffusion-tiny"] == families["random:nemotron-diffusion-8b"] == \
        "nemotron_diffusion" and families["tiny-sdar"] == "sdar"
    assert main(["generate", "--model", "random:nemotron-diffusion-tiny", "--no-chat", "abc", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    model, tok = dllm.load("random:nemotron-diffusion-tiny")
    recomputed = dllm.generate(model, tok, "abc", chat=False, cache="none")
    assert printed["cache"]["name"] == "block" and printed["outputs"][0]["token_ids"] == recomputed.token_ids[0]
    assert printed["stats"]["rows_per_layer"][0] < recomputed.stats.rows_per_layer[0]
