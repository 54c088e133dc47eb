"""WeDLM's family (issue #54, first part): our network equals transformers' Qwen3 (WeDLM-8B) and Qwen2 (WeDLM-7B)
under a causal mask, also with a window reordered filled-before-masks at its true positions (spec `wedlm.md` 1.4),
and the rank rule on the unreordered canvas gives the same logits; the config's checks and the 8B preset's shape."""
import dataclasses

import pytest
import torch
from test_models import _randomize, _write_checkpoint
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

import dllm
from dllm.models import PRESETS, DiffusionLM, wedlm
from dllm.models.checkpoint import table_names
from dllm.models.loading import load_weights
from dllm.models.transformer import visible_keys

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1e6, attn_implementation="sdpa")
LAYOUTS = {  # WeDLM-8B: Qwen3 (q/k norms, head_dim 32 != 64 / 4, tied as the small Qwen3); WeDLM-7B: Qwen2.5
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=32, attention_bias=False, tie_word_embeddings=True),
              dict(qk_norm=True, attention_bias=False, head_dim=32, tie_word_embeddings=True)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=False),
              dict(attention_bias=True, tie_word_embeddings=False)),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def reference(tmp_path_factory, request):
    """transformers' model with random weights and our WeDLM loaded from the same checkpoint directory."""
    config_class, model_class, extra, fields = LAYOUTS[request.param]
    ref = model_class(config_class(**SHAPE, **extra))
    _randomize(ref)
    hf = {k: v for k, v in SHAPE.items() if k != "attn_implementation"}
    hf.update(model_type="wedlm", architectures=["WeDLMForCausalLM"], mask_token_id=127, eos_token_id=125, **fields)
    state = {k: v for k, v in ref.state_dict().items() if not (hf["tie_word_embeddings"] and k == "lm_head.weight")}
    path = tmp_path_factory.mktemp(request.param)
    _write_checkpoint(path, hf, state)
    model = DiffusionLM(wedlm.config_from_hf(hf))
    load_weights(model, path, wedlm.WEIGHT_NAMES)
    return ref.eval(), model.eval()


def test_logits_equal_transformers_under_a_causal_mask(reference):
    ref, model = reference
    ids = torch.randint(0, 120, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = model(ids)
        bidirectional = ref(input_ids=ids, attention_mask=torch.ones(2, 1, 12, 12, dtype=torch.bool)).logits
    assert (got - want).abs().max() < 1e-4
    assert (want - bidirectional).abs().max() > 1e-2  # the causal mask took effect


def test_left_padding_equals_transformers(reference):
    ref, model = reference
    ids = torch.randint(0, 120, (2, 11), generator=torch.Generator().manual_seed(2))
    real = torch.ones(2, 11, dtype=torch.bool)
    real[0, :3] = False
    positions = (real.long().cumsum(1) - 1).clamp(min=0)
    mask = (positions[:, None, :] <= positions[:, :, None]) & real[:, None, :]
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask[:, None], position_ids=positions).logits
        got = model(ids, attention_mask=real)
    assert (got[real] - want[real]).abs().max() < 1e-4


def window_canvas(seed: int, prompt: int = 6, window: int = 8):
    """A prompt and a window of filled tokens and masks (at least one of each, not already in order): ids `[1, L]`
    and the unfilled flags `[1, L]`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 120, (1, prompt + window), generator=g)
    unfilled = torch.zeros(1, prompt + window, dtype=torch.bool)
    unfilled[0, prompt:] = torch.rand(window, generator=g) < 0.5
    unfilled[0, prompt], unfilled[0, prompt + 1], unfilled[0, -1] = True, False, False
    return torch.where(unfilled, 127, ids), unfilled


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_reordered_window_keeps_its_true_positions(reference, seed):
    """The authors' decode step: the window fed physically as [filled slots ; masks], each in position order, with
    RoPE at the true positions, under a causal mask over the physical order. transformers (explicit position_ids,
    an all-ones attention mask so that falling positions are not read as a new packed sequence) and our `run` with
    explicit positions agree; so does the rank rule on the canvas in place (rank = (unfilled, position)), the
    computation a canvas layout does without moving rows."""
    ref, model = reference
    ids, unfilled = window_canvas(seed)
    length = ids.shape[1]
    order = torch.sort(unfilled.long() * length + torch.arange(length), stable=True).indices  # filled, then masks
    physical, positions = ids.gather(1, order), order
    with torch.no_grad():
        want = ref(input_ids=physical, position_ids=positions, attention_mask=torch.ones_like(physical)).logits
        steps = torch.arange(length)[None]
        got = model.run(physical, positions, visible_keys(model.config, steps, steps, None))
        ranks = steps + length * unfilled
        in_place = model.run(ids, steps, visible_keys(model.config, ranks, ranks, None))
        plain = model(ids)
    assert (got - want).abs().max() < 1e-4
    assert (in_place.gather(1, order[..., None].expand_as(in_place)) - want).abs().max() < 1e-4
    masks = unfilled[0]
    assert (in_place[0, masks] - plain[0, masks]).abs().max() > 1e-2  # a mask saw filled slots after it


def test_config_checks():
    hf = {"vocab_size": 151936, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "model_type": "wedlm"}
    cfg = wedlm.config_from_hf(hf)  # WeDLMConfig's defaults: Qwen2.5 biases, no q/k norm, the engine's mask id
    assert (cfg.qkv_bias, cfg.qk_norm, cfg.mask_id, cfg.causal, cfg.logit_shift) == (True, False, 151665, True, 0)
    for fields in ({"qk_norm": True}, {"attention_bias": False}):
        with pytest.raises(ValueError, match="a WeDLM network has one of them"):
            wedlm.config_from_hf({**hf, **fields})
    for key, value in (("rope_scaling", {"rope_type": "yarn", "factor": 4.0}), ("use_sliding_window", True)):
        with pytest.raises(ValueError, match=f"config.json has {key}="):
            wedlm.config_from_hf({**hf, "qk_norm": True, "attention_bias": False, key: value})


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_name_table_is_exactly_the_qwen_checkpoints_names(layout):
    """WeDLM-8B's Qwen3 shape and WeDLM-7B's Qwen2.5 shape: our table's names are transformers' state dict's."""
    config_class, model_class, extra, fields = LAYOUTS[layout]
    hf = {k: v for k, v in SHAPE.items() if k != "attn_implementation"}
    cfg = wedlm.config_from_hf({**hf, **fields, "num_hidden_layers": 3, "mask_token_id": 127, "eos_token_id": 125})
    with torch.device("meta"):
        ours = table_names(DiffusionLM(cfg), wedlm.WEIGHT_NAMES)
        theirs = model_class(config_class(**{**SHAPE, **extra, "num_hidden_layers": 3})).state_dict()
    assert set(ours) == set(theirs) - ({"lm_head.weight"} if cfg.tied_head else set())


def test_8b_preset_has_qwen3_8bs_parameters():
    cfg = PRESETS["wedlm-8b"]
    with torch.device("meta"):
        qwen3 = Qwen3ForCausalLM(Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                             num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                                             head_dim=128, tie_word_embeddings=False))
    assert cfg.num_parameters() == sum(p.numel() for p in qwen3.parameters()) == 8_190_735_360
    assert (cfg.mask_id, cfg.qk_norm, cfg.qkv_bias, cfg.causal) == (151665, True, False, True)


def test_a_random_wedlm_saves_and_loads_back(tmp_path):
    model, tok = dllm.load("random:wedlm-tiny", seed=3)
    dllm.save_pretrained(model, tok, tmp_path)
    loaded, _ = dllm.load(str(tmp_path))
    assert dataclasses.replace(loaded.config, stop_ids=model.config.stop_ids) == model.config
    assert tok.convert_tokens_to_ids("<|im_end|>") in loaded.config.stop_ids  # the directory's end of turn
    ids = torch.randint(0, 100, (1, 8))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
