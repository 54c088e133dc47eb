"""DiffusionGemma (issue #37, spec `new_families.md` section 1): the native network equals transformers'
`DiffusionGemmaForBlockDiffusion` on tiny random weights saved with `save_pretrained` and loaded through our
loader, in both modes (encoder over a left-padded prompt and over a committed canvas; decoder with and without
self-conditioning), with a sliding window shorter than the context so the window rule is exercised."""
import json

import pytest
import torch
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, DynamicCache

import dllm
from dllm.core.errors import DllmError
from dllm.models import PRESETS, diffusion_gemma
from dllm.models.gemma import DiffusionGemma
from dllm.models.loading import checkpoint_state, save_pretrained
from dllm.models.tokenizer import build_char_tokenizer, save_tokenizer

TINY_VISION = dict(model_type="gemma4_vision", hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=2, head_dim=4, position_embedding_size=8, patch_size=2)
PROMPTS = [[2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [2, 60, 61, 62, 63]]  # 12 and 5 tokens, window 8
TOLERANCE = 2e-5  # float32; measured max |difference| of the logits: see the report in test output


class Store:
    """A full-length key/value store with each layer's own shape (`DiffusionGemma.kv_shapes`): writes the rows
    it is given, returns every row (the mask decides what a query sees)."""

    def __init__(self, model, batch, length):
        self.k = [torch.zeros(batch, h, length, d) for h, d in model.kv_shapes()]
        self.v = [torch.zeros(batch, h, length, d) for h, d in model.kv_shapes()]

    def update(self, layer, rows, q, k, v):
        self.k[layer][:, :, rows.index], self.v[layer][:, :, rows.index] = k, v
        return self.k[layer], self.v[layer]


def _randomize(ref, seed=0):
    """Every weight and scale away from its initial value (norms, layer scalars and router scales included) and
    routers sharp enough that no two experts tie."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*ref.named_parameters(), *ref.named_buffers()]:
            if "rotary" in name or "inv_freq" in name or "embed_scale" in name:
                continue
            if name.endswith(("norm.weight", "scale", "layer_scalar")):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("router.proj.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """transformers' model built from the tiny preset's config.json, and ours loaded from its save_pretrained."""
    hf = diffusion_gemma.hf_config(PRESETS["diffusion-gemma-tiny"])
    ref = DiffusionGemmaForBlockDiffusion(DiffusionGemmaConfig(**{**hf, "vision_config": TINY_VISION})).eval()
    _randomize(ref)
    path = tmp_path_factory.mktemp("dgemma")
    ref.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7], "max_new_tokens": 32}))
    save_tokenizer(build_char_tokenizer("llada"), path)
    model, _ = dllm.load(str(path))
    return ref, model, path


def _layout(canvases=2):
    """The left-padded canvas `[pad | prompt | canvas x canvases]`: tokens' real mask and RoPE positions."""
    width, size = max(map(len, PROMPTS)), PRESETS["diffusion-gemma-tiny"].block_size
    real = torch.tensor([[False] * (width - len(p)) + [True] * (len(p) + canvases * size) for p in PROMPTS])
    prompt = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    return prompt, real, (real.long().cumsum(1) - 1).clamp(min=0), width, size


def _softcapped(ref, hidden):
    cap = ref.config.text_config.final_logit_softcapping
    return torch.tanh(ref.lm_head(hidden) / cap) * cap


def _max_diff(a, b, real):
    return (a - b)[real].abs().max().item()


def test_both_modes_equal_transformers(pair):
    ref, model, _ = pair
    prompt, real, positions, width, size = _layout()
    g = torch.Generator().manual_seed(3)
    first, committed, second = (torch.randint(0, 128, (len(PROMPTS), size), generator=g) for _ in range(3))
    cols = [slice(0, width), slice(width, width + size), slice(width + size, width + 2 * size)]
    store, cache = Store(model, len(PROMPTS), real.shape[1]), DynamicCache(config=ref.config.get_text_config())
    diffs = {}

    def ours(tokens, col, decoder, sc=None):
        masks = model.visible_keys(positions[:, col], positions, real, decoder)
        return model.run(tokens, positions[:, col], masks, store, dllm.models.Rows(col), decoder=decoder,
                         self_conditioning=sc)

    def theirs_decoder(tokens, col, sc=None):
        return ref(cache=cache, decoder_input_ids=tokens, decoder_attention_mask=real[:, :col.stop],
                   decoder_position_ids=positions[:, col], self_conditioning_logits=sc).logits

    def theirs_encoder(tokens, col):
        out = ref.model.encoder(input_ids=tokens, attention_mask=real[:, :col.stop], cache=cache,
                                position_ids=positions[:, col])
        return _softcapped(ref, out.last_hidden_state)

    with torch.no_grad():
        diffs["encoder, prompt"] = _max_diff(ours(prompt, cols[0], False), theirs_encoder(prompt, cols[0]),
                                             real[:, cols[0]])
        plain = ours(first, cols[1], True)
        diffs["decoder"] = _max_diff(plain, theirs_decoder(first, cols[1]), real[:, cols[1]])
        scaled = plain / 0.7  # a temperature-scaled previous step, as the sampler passes it on
        conditioned = ours(first, cols[1], True, scaled)
        diffs["decoder, self-conditioned"] = _max_diff(conditioned, theirs_decoder(first, cols[1], scaled),
                                                       real[:, cols[1]])
        diffs["encoder, committed canvas"] = _max_diff(ours(committed, cols[1], False),
                                                       theirs_encoder(committed, cols[1]), real[:, cols[1]])
        diffs["decoder, second canvas"] = _max_diff(ours(second, cols[2], True, scaled),
                                                    theirs_decoder(second, cols[2], scaled), real[:, cols[2]])
    print("max |logit difference| vs transformers (float32):", diffs)
    assert max(diffs.values()) < TOLERANCE, diffs
    assert (conditioned - plain).abs().max() > 0.1  # self-conditioning changes the logits


def test_padded_row_equals_alone(pair):
    """A left-padded row gives the logits of its prompt decoded alone (RoPE positions count real tokens)."""
    _, model, _ = pair
    prompt, real, positions, width, size = _layout(canvases=1)
    canvas = torch.randint(0, 128, (len(PROMPTS), size), generator=torch.Generator().manual_seed(5))

    def decode(tokens, real, positions, canvas):
        store, prompt_cols = Store(model, len(tokens), real.shape[1]), slice(0, tokens.shape[1])
        canvas_cols = slice(tokens.shape[1], real.shape[1])
        model.run(tokens, positions[:, prompt_cols], model.visible_keys(positions[:, prompt_cols], positions, real,
                                                                          False), store, dllm.models.Rows(prompt_cols),
                  decoder=False)
        return model.run(canvas, positions[:, canvas_cols], model.visible_keys(positions[:, canvas_cols], positions,
                                                                               real, True),
                         store, dllm.models.Rows(canvas_cols))

    with torch.no_grad():
        batch = decode(prompt, real, positions, canvas)
        short = len(PROMPTS[1])
        alone = decode(prompt[1:, width - short:], real[1:, width - short:], positions[1:, width - short:], canvas[1:])
    torch.testing.assert_close(batch[1:], alone, atol=1e-5, rtol=0)


def test_loading(pair):
    """The vision tower is skipped, the encoder keeps its own layer scalars, generation_config's eos ids stop a
    row, and our checkpoint names round-trip."""
    ref, model, path = pair
    assert isinstance(model, DiffusionGemma) and model.config.mask_id is None
    assert model.config.stop_ids == (1, 7) and model.generation_defaults == {"gen_length": 32}
    for i, layer in enumerate(model.layers):
        assert layer.encoder_scale.item() == ref.model.encoder.language_model.layers[i].layer_scalar.item()
        assert layer.decoder_scale.item() == ref.model.decoder.layers[i].layer_scalar.item()
        assert layer.encoder_scale.item() != layer.decoder_scale.item()
    assert model.config.num_parameters() == sum(p.numel() for p in model.parameters())
    state = checkpoint_state(model)
    assert not any(name.startswith("model.encoder.vision_tower") for name in state)
    save_pretrained(model, None, path / "ours")
    again = DiffusionGemmaConfig.from_pretrained(path / "ours")  # transformers reads our config.json
    assert again.text_config.per_layer_config[2].head_dim == 32 and again.canvas_length == 16


def test_config_refusals():
    hf = diffusion_gemma.hf_config(PRESETS["diffusion-gemma-tiny"])
    bidirectional = {**hf, "text_config": {**hf["text_config"], "use_bidirectional_attention": "all"}}
    with pytest.raises(ValueError, match="encoder is causal"):
        diffusion_gemma.config_from_hf(bidirectional)
    scaled = {**hf, "text_config": {**hf["text_config"], "rope_parameters": {
        "full_attention": {"rope_type": "proportional", "rope_theta": 1e6, "factor": 8.0}}}}
    with pytest.raises(ValueError, match="unscaled proportional RoPE"):
        diffusion_gemma.config_from_hf(scaled)


def test_released_config_reads_as_the_preset():
    """The released config.json's layout (global_head_dim, num_global_key_value_heads, 5:1 layers) gives the
    26B-A4B preset."""
    want = PRESETS["diffusion-gemma-26b-a4b"]
    text = {k: v for k, v in diffusion_gemma.hf_config(want)["text_config"].items() if k != "layer_types"}
    got = diffusion_gemma.config_from_hf({"canvas_length": 256, "image_token_id": 258_880, "text_config": text})
    assert got == want
    assert round(want.num_parameters() / 1e9, 2) == 25.25


def test_generation_is_refused_by_name():
    model, tok = dllm.load("random:diffusion-gemma-tiny")
    with pytest.raises(DllmError, match="uniform-state"):
        dllm.generate(model, tok, ["hi"], gen_length=16)
