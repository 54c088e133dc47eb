"""LLaDA2, LLaDA-MoE and Fast-dLLM v2 (issue #20): each network equals transformers' own class on tiny random
weights loaded from a checkpoint under the official names (LLaDA2 = Glm4Moe's layout with fused qkv: partial
RoPE, q/k norm, dense layer 0, sigmoid group-limited router with expert bias, shared expert; its MoE layer also
against DeepSeek-V3's), the name tables cover what the released configs imply, and the exact block cache equals
recomputing everything."""
import json

import pytest
import torch
from conftest import shared_path
from test_block_diffusion import PROMPTS, block_causal
from test_models import _randomize, _write_checkpoint
from transformers import (
    DeepseekV3Config,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

import dllm
from dllm import cache as caches
from dllm import samplers
from dllm.engine import decode
from dllm.models import PRESETS, DiffusionLM, MoEConfig, fast_dllm_v2, llada2, llada_moe, sdar
from dllm.models.checkpoint import save_pretrained, table_names
from dllm.models.loading import load, load_weights
from dllm.models.moe import MoE


def _sharpen_routers(model, bias_name=None, seed=0):
    """Router weights large enough that no two experts tie; a random expert bias."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if bias_name and name.endswith(bias_name):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))


def _per_expert(state: dict, prefix: str) -> dict:
    """transformers' stacked experts (`gate_up_proj [E, 2F, D]`, `down_proj [E, D, F]`) as one tensor per expert."""
    gate_up, down = state.pop(prefix + "gate_up_proj"), state.pop(prefix + "down_proj")
    out = {}
    for e in range(gate_up.shape[0]):
        gate, up = gate_up[e].chunk(2)
        out |= {f"{prefix}{e}.gate_proj.weight": gate, f"{prefix}{e}.up_proj.weight": up,
                f"{prefix}{e}.down_proj.weight": down[e]}
    return out


def _checkpoint(ref, rename) -> dict:
    """The reference's tensors under the official checkpoint names (`rename(name, state)` edits in place)."""
    state = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
    state = {k: v.detach().clone() for k, v in state.items() if "rotary" not in k and "inv_freq" not in k}
    for name in [k for k in state if k.endswith("experts.gate_up_proj")]:
        state |= _per_expert(state, name.removesuffix("gate_up_proj"))
    rename(state)
    return state


def _native(arch, preset, state, path, **hf_keys):
    hf = {**arch.hf_config(PRESETS[preset]), **hf_keys}
    _write_checkpoint(path, hf, state)
    model = DiffusionLM(arch.config_from_hf(hf))
    load_weights(model, path, arch.WEIGHT_NAMES)
    return model.eval()


@pytest.fixture(scope="module")
def llada2_pair(tmp_path_factory):
    cfg = Glm4MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        rope_parameters={"rope_type": "default", "rope_theta": 600000.0, "partial_rotary_factor": 0.5},
                        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                        routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=True,
                        rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                        attn_implementation="sdpa")
    ref = Glm4MoeForCausalLM(cfg)
    _randomize(ref)
    _sharpen_routers(ref, "e_score_correction_bias")

    def rename(state):
        state["model.word_embeddings.weight"] = state.pop("model.embed_tokens.weight")
        for i in range(2):
            old, new = f"model.layers.{i}.self_attn.", f"model.layers.{i}.attention."
            state[new + "query_key_value.weight"] = torch.cat([state.pop(old + f"{p}_proj.weight") for p in "qkv"])
            for a, b in (("q_norm", "query_layernorm"), ("k_norm", "key_layernorm"), ("o_proj", "dense")):
                state[f"{new}{b}.weight"] = state.pop(f"{old}{a}.weight")
        state["model.layers.1.mlp.gate.expert_bias"] = state.pop("model.layers.1.mlp.gate.e_score_correction_bias")

    model = _native(llada2, "llada2-tiny", _checkpoint(ref, rename), tmp_path_factory.mktemp("llada2"))
    return ref.eval(), model


def test_llada2_equals_glm4_moe_under_a_block_causal_mask(llada2_pair):
    ref, model = llada2_pair
    ids = torch.randint(0, 120, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = block_causal(12)[None, None].expand(2, 1, 12, 12)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).logits
        got = model(ids)
    assert (got - want).abs().max() < 1e-4
    assert model.config.rope_dim == 8 and model.config.head_dim == 16  # half the head dims rotate
    assert isinstance(model.layers[1].moe, MoE) and not hasattr(model.layers[0], "moe")  # layer 0 dense


def test_llada2_moe_layer_equals_deepseek_v3():
    """Router (sigmoid, expert bias that only chooses, groups), grouped experts, renormalised and scaled
    weights and the shared expert against transformers' DeepseekV3MoE."""
    ref = DeepseekV3MoE(DeepseekV3Config(hidden_size=48, moe_intermediate_size=16, n_routed_experts=16,
                                         num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
                                         routed_scaling_factor=2.5, norm_topk_prob=True))
    _randomize(ref)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        ref.gate.weight.copy_(torch.randn(ref.gate.weight.shape, generator=g))
        ref.gate.e_score_correction_bias.copy_(0.3 * torch.randn(16, generator=g))
    ours = MoE(48, MoEConfig(n_experts=16, top_k=4, expert_size=16, shared_size=16, router="sigmoid",
                             expert_bias=True, groups=4, groups_kept=2, normalize=True, scaling=2.5))
    with torch.no_grad():
        ours.router.weight.copy_(ref.gate.weight)
        ours.expert_bias.copy_(ref.gate.e_score_correction_bias)
        ours.experts_gate_up.copy_(ref.experts.gate_up_proj)
        ours.experts_down.copy_(ref.experts.down_proj)
        ours.shared.gate_up_proj.weight.copy_(torch.cat((ref.shared_experts.gate_proj.weight,
                                                         ref.shared_experts.up_proj.weight)))
        ours.shared.down_proj.weight.copy_(ref.shared_experts.down_proj.weight)
        x = torch.randn(3, 7, 48, generator=g)
        want, got = ref(x), ours(x)
        unbiased = MoE(48, ours.cfg)
        unbiased.load_state_dict({**ours.state_dict(), "expert_bias": torch.zeros(16)})
    assert (got - want).abs().max() < 1e-5
    assert (unbiased(x) - want).abs().max() > 1e-3  # the bias changed which experts were chosen


def _qwen3_moe(kv_heads: int, normalize: bool, theta: float, eps: float):
    """transformers' Qwen3-MoE in the tiny presets' shape, random weights, routers that never tie."""
    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=normalize, rope_theta=theta,
                         rms_norm_eps=eps, tie_word_embeddings=False, attn_implementation="sdpa")
    ref = Qwen3MoeForCausalLM(cfg)
    _randomize(ref)
    _sharpen_routers(ref)
    return ref


@pytest.fixture(scope="module")
def llada_moe_pair(tmp_path_factory):
    ref = _qwen3_moe(kv_heads=4, normalize=False, theta=50000.0, eps=1e-5)
    model = _native(llada_moe, "llada-moe-tiny", _checkpoint(ref, lambda state: None),
                    tmp_path_factory.mktemp("llada_moe"))
    return ref.eval(), model


def test_llada_moe_equals_qwen3_moe_with_full_attention(llada_moe_pair):
    ref, model = llada_moe_pair
    ids = torch.randint(0, 120, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=torch.ones(2, 1, 12, 12, dtype=torch.bool)).logits
        causal = ref(input_ids=ids).logits
        got = model(ids)
    assert (got - want).abs().max() < 1e-4
    assert (want - causal).abs().max() > 1e-2  # bidirectional: the mask took effect


@pytest.mark.parametrize("tied", [False, True])
def test_fast_dllm_v2_equals_qwen2_with_shifted_logits(tmp_path, tied):
    """Tied: the checkpoint has no lm_head (Fast_dLLM_v2_1.5B keeps Qwen2.5-1.5B's tie_word_embeddings)."""
    cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1e6,
                      tie_word_embeddings=tied, attn_implementation="sdpa")
    ref = Qwen2ForCausalLM(cfg)
    _randomize(ref)
    drop_head = lambda state: state.pop("lm_head.weight", None) if tied else None  # noqa: E731
    model = _native(fast_dllm_v2, "fast-dllm-v2-tiny", _checkpoint(ref, drop_head), tmp_path,
                    tie_word_embeddings=tied)
    ids = torch.randint(0, 120, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=block_causal(12)[None, None].expand(2, 1, 12, 12)).logits
        got = model(ids)
    assert (got[:, 1:] - want[:, :-1]).abs().max() < 1e-4  # hidden i-1 scores token i


def _llada2_names(hf: dict) -> set[str]:
    """Every tensor name the LLaDA2 release's config implies, written out from the spec's naming."""
    names = {"model.word_embeddings.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names |= {p + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                  "attention.query_key_value.weight", "attention.query_layernorm.weight",
                                  "attention.key_layernorm.weight", "attention.dense.weight")}
        if i < hf["first_k_dense_replace"]:
            names |= {f"{p}mlp.{w}_proj.weight" for w in ("gate", "up", "down")}
            continue
        names |= {p + "mlp.gate.weight", p + "mlp.gate.expert_bias"}
        names |= {f"{p}mlp.shared_experts.{w}_proj.weight" for w in ("gate", "up", "down")}
        names |= {f"{p}mlp.experts.{e}.{w}_proj.weight" for e in range(hf["num_experts"])
                  for w in ("gate", "up", "down")}
    return names


def test_llada2_name_table_covers_the_released_config():
    hf = json.loads(shared_path("data/llada2-mini/config.json").read_text())
    cfg = llada2.config_from_hf({**hf, "mask_token_id": 156895})
    assert cfg == PRESETS["llada2-mini"] and cfg.rope_dim == 64 and cfg.block_size == 32
    with torch.device("meta"):
        model = DiffusionLM(cfg)
    names = table_names(model, llada2.WEIGHT_NAMES)
    assert set(names) == _llada2_names(hf) and len(names) == 3 + 9 + 19 * (6 + 2 + 3 + 3 * 256)
    assert 16.0e9 < cfg.num_parameters() < 16.5e9  # "LLaDA2.0-mini (16B)"
    # the official gate renormalizes the top-k weights whenever k > 1 and never for k = 1, whatever the flag says
    assert llada2.config_from_hf({**hf, "mask_token_id": 156895, "norm_topk_prob": False}).moe.normalize
    assert not llada2.config_from_hf({**hf, "mask_token_id": 156895, "num_experts_per_tok": 1}).moe.normalize


def test_checkpoints_round_trip_and_dispatch(tmp_path):
    """save_pretrained writes the official names; loading picks the architecture by class (LLaDA-MoE's
    config says model_type "llada", like LLaDA's) and gives the same logits."""
    ids = torch.randint(0, 120, (2, 10), generator=torch.Generator().manual_seed(2))
    for preset in ("llada2-tiny", "llada-moe-tiny", "fast-dllm-v2-tiny"):
        model, tok = load(f"random:{preset}", seed=3)
        save_pretrained(model, tok, tmp_path / preset)
        again, _ = load(str(tmp_path / preset))
        assert again.config.arch == model.config.arch and again.config.moe == model.config.moe
        assert torch.equal(again(ids), model(ids))
    assert json.loads((tmp_path / "llada-moe-tiny" / "config.json").read_text())["model_type"] == "llada"


@pytest.mark.parametrize("preset", ["llada2-tiny", "fast-dllm-v2-tiny"])
@pytest.mark.parametrize("sampler,args", [("threshold", {"threshold": 0.3}), ("low_confidence_dynamic", {})])
def test_exact_block_cache_on_block_causal_moe_and_shifted_models(preset, sampler, args):
    model = dllm.load(f"random:{preset}", seed=1)[0]
    block = model.config.block_size

    def run(cache):
        return decode(model, PROMPTS, samplers.SAMPLERS.create(sampler, **args), caches.CACHES.create(cache), 16,
                      block)

    want, want_stats, _ = run("none")
    for cache in ("block", "dual", "prefix"):
        got, stats, _ = run(cache)
        assert torch.equal(got.tokens, want.tokens), cache
        assert stats.nfe == want_stats.nfe
    # a prompt shorter than a block, alone: the first block starts at column 0 (with shifted logits, the row
    # before it does not exist; its first position is a prompt token)
    short = [decode(model, [[5, 6, 7]], samplers.SAMPLERS.create(sampler, **args), caches.CACHES.create(cache), 8,
                    block)[0].tokens for cache in ("none", "block", "dual", "prefix")]
    assert all(torch.equal(t, short[0]) for t in short)


def test_llada_moe_runs_every_cache_batch_equal_alone():
    """A full-attention MoE model: the LLaDA caches apply; a batch row equals its prompt alone (routing is per
    token, so neighbours never change a row's experts)."""
    model = dllm.load("random:llada-moe-tiny", seed=1)[0]
    s = samplers.SAMPLERS.create("low_confidence")
    for cache in ("none", "dual", "dkv", "elastic"):
        batch, _, _ = decode(model, PROMPTS, s, caches.CACHES.create(cache), 16, 8)
        for row, prompt in enumerate(PROMPTS):
            alone, _, _ = decode(model, [prompt], s, caches.CACHES.create(cache), 16, 8)
            assert torch.equal(batch.tokens[row, batch.prompt_length:], alone.tokens[0, alone.prompt_length:])


def test_bench_counts_the_experts_a_forward_reads():
    """`dllm bench` on an MoE model reports the fraction of routed experts one forward reads (between one
    token's top-k and all of them) and the parameters that leaves to read, for the weight-read floor."""
    from dllm.engine.bench import bench

    model = dllm.load("random:llada2-tiny", seed=1)[0]
    moe = model.config.moe
    r = bench(model, samplers.SAMPLERS.create("low_confidence"), caches.CACHES.create("block"), 8, 4, repeats=1,
              prompt_length=6)
    assert moe.top_k / moe.n_experts < r["model"]["experts_read"] <= 1
    assert r["model"]["parameters_read"] < r["model"]["parameters"] or r["model"]["experts_read"] == 1


def test_sdar_moe_equals_qwen3_moe_under_a_block_causal_mask(tmp_path):
    """SDAR-30B-A3B's layout: Qwen3-MoE (top-k renormalised) under the block-causal mask."""
    ref = _qwen3_moe(kv_heads=2, normalize=True, theta=1e6, eps=1e-6)
    model = _native(sdar, "sdar-moe-tiny", _checkpoint(ref, lambda state: None), tmp_path)
    ids = torch.randint(0, 120, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=block_causal(12)[None, None].expand(2, 1, 12, 12)).logits
        got = model(ids)
    assert (got - want).abs().max() < 1e-4 and model.config.moe.normalize


def test_experts_without_grouped_mm_agree():
    """The per-expert fallback (a GPU in fp32/fp16; fp64 here) computes what F.grouped_mm does; outside bf16 a
    model with MoE layers refuses --compile with the fix."""
    model = dllm.load("random:llada2-tiny", seed=1)[0]
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        grouped = model.layers[1].moe(x)
        looped = model.layers[1].moe.double()(x.double())
    assert (grouped.double() - looped).abs().max() < 1e-5
    with pytest.raises(dllm.DllmError, match=r"MoE layers \(llada2\) compile in bfloat16 only .* use --dtype "
                                             r"bfloat16 or drop --compile"):
        decode(dllm.load("random:llada2-tiny")[0], PROMPTS, samplers.SAMPLERS.create("low_confidence"),
               caches.CACHES.create("block"), 8, 4, compile=True)


@pytest.mark.parametrize("cache", ["block", "dual"])
def test_moe_decoding_compiles_to_one_graph_in_bf16(monkeypatch, cache):
    """In bf16 the MoE layers (tokens sorted by expert, static-shape group ends, F.grouped_mm) trace with the rest
    of the block step into one graph (`fullgraph=True` fails on any break); the compiled decode gives the eager
    tokens (aot_eager runs the traced aten ops, so equality is exact)."""
    model = dllm.load("random:llada2-tiny", dtype=torch.bfloat16, seed=3)[0]
    args = (model, PROMPTS, samplers.SAMPLERS.create("threshold", threshold=0.5), caches.CACHES.create(cache), 8, 4)
    want = decode(*args)[0].tokens
    torch._dynamo.reset()
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, **kw, backend="aot_eager"))
    assert torch.equal(decode(*args, compile=True)[0].tokens, want)
