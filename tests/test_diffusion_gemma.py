"""DiffusionGemma (issue #37, spec `new_families.md` section 1): the native network equals transformers'
`DiffusionGemmaForBlockDiffusion` on tiny random weights saved with `save_pretrained` and loaded through our
loader, in both modes (encoder over a left-padded prompt and over a committed canvas; decoder with and without
self-conditioning), with a sliding window shorter than the context so the window rule is exercised; composed
with the entropy-bound rule, it generates transformers' very tokens from the same seed."""
import copy
import dataclasses
import json
import shutil

import pytest
import torch
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, DynamicCache

import dllm
from dllm import samplers
from dllm.cli import main
from dllm.core.errors import DllmError
from dllm.cache import CACHES
from dllm.engine.canvas import Canvas
from dllm.engine.likelihood import elbo
from dllm.engine.decoding import decode
from dllm.engine.options import decoding_lengths, settle
from dllm.models import PRESETS, diffusion_gemma
from dllm.models.gemma import DiffusionGemma
from dllm.models.checkpoint import checkpoint_state, save_pretrained
from dllm.models.loading import build_model
from dllm.models.tokenizer import build_char_tokenizer, save_tokenizer
from dllm.samplers.entropy_bound import EntropyBound, entropy_bound_step, new_history, random_canvas

TINY_VISION = dict(model_type="gemma4_vision", hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=2, head_dim=4, position_embedding_size=8, patch_size=2)
PROMPTS = [[2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [2, 60, 61, 62, 63]]  # 12 and 5 tokens, window 8
TOLERANCE = 2e-5  # float32 logits; measured: at most 5.2e-6 (printed by the test)


class Columns:
    """A batch's canvas columns `[pad | prompt | canvases]` as a cache would hold them: RoPE positions counting
    real tokens, the real-token mask, and a full-length key/value store with each layer's own shape
    (`DiffusionGemma.kv_shapes`) that writes the rows it is given and returns every row (the masks decide what a
    query sees)."""

    def __init__(self, model, real):
        self.model, self.real = model, real
        self.positions = (real.long().cumsum(1) - 1).clamp(min=0)
        shape = [(len(real), h, real.shape[1], d) for h, d in model.kv_shapes()]
        self.k, self.v = ([torch.zeros(s, dtype=model.dtype) for s in shape] for _ in range(2))

    def update(self, layer, rows, q, k, v):
        self.k[layer][:, :, rows.index], self.v[layer][:, :, rows.index] = k, v
        return self.k[layer], self.v[layer]

    def run(self, ids, start, decoder, self_conditioning=None):
        """Logits of `ids` at columns `[start, start + len)` in one mode, their K/V written."""
        cols = slice(start, start + ids.shape[1])
        positions = self.positions[:, cols]
        window = (positions[:, 0], positions[:, -1] + 1) if decoder else None
        masks = self.model.visible_keys(positions, self.positions, self.real, window)
        return self.model.run(ids, positions, masks, self, dllm.models.Rows(cols),
                              self_conditioning=self_conditioning)


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
    """The left-padded prompts and the real-token mask of `[pad | prompt | canvas x canvases]`."""
    width, size = max(map(len, PROMPTS)), PRESETS["diffusion-gemma-tiny"].canvas_length
    real = torch.tensor([[False] * (width - len(p)) + [True] * (len(p) + canvases * size) for p in PROMPTS])
    return torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS]), real, width, size


def _softcapped(ref, hidden):
    cap = ref.config.text_config.final_logit_softcapping
    return torch.tanh(ref.lm_head(hidden) / cap) * cap


def test_both_modes_equal_transformers(pair):
    ref, model, _ = pair
    prompt, real, width, size = _layout()
    g = torch.Generator().manual_seed(3)
    first, committed, second = (torch.randint(0, 128, (len(PROMPTS), size), generator=g) for _ in range(3))
    ours, cache = Columns(model, real), DynamicCache(config=ref.config.get_text_config())
    positions, diffs = ours.positions, {}

    def theirs(tokens, start, decoder, sc=None):
        cols = slice(start, start + tokens.shape[1])
        if decoder:
            return ref(cache=cache, decoder_input_ids=tokens, decoder_attention_mask=real[:, :cols.stop],
                       decoder_position_ids=positions[:, cols], self_conditioning_logits=sc).logits
        out = ref.model.encoder(input_ids=tokens, attention_mask=real[:, :cols.stop], cache=cache,
                                position_ids=positions[:, cols])
        return _softcapped(ref, out.last_hidden_state)

    def compare(name, tokens, start, decoder, sc=None):
        got = ours.run(tokens, start, decoder, sc)
        diffs[name] = (got - theirs(tokens, start, decoder, sc))[real[:, start:start + tokens.shape[1]]].abs().max()
        return got

    with torch.no_grad():
        compare("encoder, prompt", prompt, 0, False)
        plain = compare("decoder", first, width, True)
        scaled = plain / 0.7  # a temperature-scaled previous step, as the sampler passes it on
        conditioned = compare("decoder, self-conditioned", first, width, True, scaled)
        compare("encoder, committed canvas", committed, width, False)
        compare("decoder, second canvas", second, width + size, True, scaled)
    print("max |logit difference| vs transformers (float32):", {k: f"{v:.1e}" for k, v in diffs.items()})
    assert max(diffs.values()) < TOLERANCE, diffs
    assert (conditioned - plain).abs().max() > 0.1  # self-conditioning changes the logits


def test_padded_row_equals_alone(pair):
    """A left-padded row gives the logits of its prompt decoded alone (RoPE positions count real tokens)."""
    _, model, _ = pair
    prompt, real, width, size = _layout(canvases=1)
    canvas = torch.randint(0, 128, (len(PROMPTS), size), generator=torch.Generator().manual_seed(5))
    short = width - len(PROMPTS[1])
    with torch.no_grad():
        batch, alone = Columns(model, real), Columns(model, real[1:, short:])
        batch.run(prompt, 0, False)
        alone.run(prompt[1:, short:], 0, False)
        torch.testing.assert_close(batch.run(canvas, width, True)[1:], alone.run(canvas[1:], width - short, True),
                                   atol=1e-5, rtol=0)


def test_loading(pair):
    """The vision tower is skipped, the encoder keeps its own layer scalars, generation_config's eos ids stop a
    row, and our checkpoint names round-trip."""
    ref, model, path = pair
    assert isinstance(model, DiffusionGemma) and model.config.mask_id is None
    assert model.config.stop_ids == (1, 7) and model.generation_defaults.values == {"gen_length": 32}
    for i, layer in enumerate(model.layers):
        assert layer.encoder_scale.item() == ref.model.encoder.language_model.layers[i].layer_scalar.item()
        assert layer.decoder_scale.item() == ref.model.decoder.layers[i].layer_scalar.item()
        assert layer.encoder_scale.item() != layer.decoder_scale.item()
    assert model.config.num_parameters() == sum(p.numel() for p in model.parameters())
    state = checkpoint_state(model)
    assert not any(name.startswith("model.encoder.vision_tower") for name in state)
    save_pretrained(model, build_char_tokenizer("llada"), path / "ours")
    again = DiffusionGemmaConfig.from_pretrained(path / "ours")  # transformers reads our config.json
    assert again.text_config.per_layer_config[2].head_dim == 32 and again.canvas_length == 16
    reloaded = dict(dllm.load(str(path / "ours"))[0].named_parameters())
    assert all(torch.equal(p, reloaded[name]) for name, p in model.named_parameters())


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


def test_listed_with_its_family(capsys):
    assert main(["list", "models", "--json"]) == 0
    listed = {e["name"]: e["family"] for e in json.loads(capsys.readouterr().out)}
    assert listed["random:diffusion-gemma-tiny"] == listed["random:diffusion-gemma-26b-a4b"] == "diffusion_gemma"
    assert listed["tiny-llada"] == "llada"


@pytest.fixture(scope="module")
def quiet(pair):
    """Ours of `pair` with self-conditioning's output weights at transformers' initial scale (see the replay test):
    float32 rounding differences between batch layouts stay far below what flips a sample."""
    model = copy.deepcopy(pair[1])
    with torch.no_grad():
        model.self_conditioning.mlp.down_proj.weight.mul_(0.2)
    return model


def test_a_padded_row_and_every_exact_cache_give_the_tokens_alone(quiet):
    """Rows of different lengths decoded together (left-padded, each from its seed) give their tokens decoded
    alone, with every cache DiffusionGemma takes (block: each committed canvas encoded in the next one's first
    forward; none, prefix, dual: everything or the canvas recomputed), and the block cache computes fewest rows."""
    rule, seeds = EntropyBound(), [3, 8]
    alone = [decode(quiet, [p], rule, CACHES.create("none"), 48, 16, 36, seed=s)[0] for p, s in zip(PROMPTS, seeds)]
    rows = {}
    for cache in ("block", "none", "prefix", "dual"):
        canvas, stats, _ = decode(quiet, PROMPTS, rule, CACHES.create(cache), 48, 16, 36, seed=seeds)
        for b, one in enumerate(alone):
            assert torch.equal(canvas.tokens[b, canvas.prompt_length:], one.tokens[0, one.prompt_length:]), cache
        rows[cache] = sum(stats.rows_per_layer)
    assert rows["block"] < rows["dual"] < rows["prefix"] < rows["none"]
    assert len({tuple(t.tokens[0, t.prompt_length:].tolist()) for t in alone}) == 2


def test_the_samplers_and_caches_it_cannot_take_are_refused_by_name(quiet):
    """Every masked sampler refuses the uniform-state model, entropy_bound refuses a masked one, and the caches
    that choose rows token by token are refused; each in one line, before any work."""
    for cls in samplers.SAMPLERS:
        if cls.name == "entropy_bound":
            continue
        with pytest.raises(DllmError, match=f"sampler '{cls.name}' cannot decode diffusion_gemma: .*uniform-state"):
            decode(quiet, PROMPTS[:1], cls(), CACHES.create("block"), 16, 16)
    llada = build_model(PRESETS["llada-tiny"], "cpu", torch.float32)
    with pytest.raises(DllmError, match="sampler 'entropy_bound' cannot decode llada: .*masked model"):
        decode(llada, PROMPTS[:1], EntropyBound(), CACHES.create("none"), 16, 16)
    for cache in ("dkv", "dkv_greedy", "elastic"):
        with pytest.raises(DllmError, match=f"cache '{cache}' (chooses rows .*use cache block \\(exact\\), none, "
                                            f"prefix or dual|needs a sampler whose next commits are known)"):
            decode(quiet, PROMPTS[:1], EntropyBound(), CACHES.create(cache), 16, 16)
    with pytest.raises(DllmError, match="unknown parameter 'temperature' for sampler 'entropy_bound'"):
        samplers.SAMPLERS.create("entropy_bound", temperature=0.5)
    with pytest.raises(DllmError, match="uniform-state .*the likelihood here is a masked diffusion ELBO"):
        elbo(quiet, PROMPTS[0], [5, 6])


def test_defaults_come_from_generation_config(pair, tmp_path):
    """No sampler named: entropy_bound, its parameters from generation_config.json (transformers' keys) under the
    caller's; a block per canvas and max_denoising_steps steps per block."""
    _, _, path = pair
    directory = tmp_path / "dgemma"
    shutil.copytree(path, directory)
    (directory / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [1, 7], "max_new_tokens": 32, "max_denoising_steps": 5, "t_min": 0.3, "t_max": 0.9,
        "stability_threshold": 2, "confidence_threshold": 0.01,
        "sampler_config": {"entropy_bound": 0.2, "_cls_name": "EntropyBoundSamplerConfig"}}))
    model, tok = dllm.load(str(directory))
    assert decoding_lengths(model) == {"gen_length": 32, "block_length": 16, "steps": 10}
    out = dllm.generate(model, tok, ["hi"], stability=0, stop_early=False)
    assert out.sampler == {"name": "entropy_bound", "bound": 0.2, "t_max": 0.9, "t_min": 0.3, "stability": 0,
                           "confidence": 0.01}
    assert out.cache["name"] == "block" and out.stats.nfe <= 10
    explained = settle(model, params={"stability": 0}).explain()  # where each came from (dllm generate --explain)
    assert set(explained["generation_config.json"]) == set(json.loads((directory / "generation_config.json")
                                                                      .read_text()))
    settings = explained["settings"]
    assert settings["sampler.t_min"] == {"value": 0.3, "from": "generation_config.json (t_min)"}
    assert settings["sampler.confidence"] == {"value": 0.01, "from": "generation_config.json (confidence_threshold)"}
    assert settings["sampler.stability"] == {"value": 0, "from": "caller"}
    assert settings["sampler.bound"]["from"].startswith("diffusion_gemma authors' decoding")
    assert settings["steps"]["value"] == 10 and settings["steps"]["from"].startswith("diffusion_gemma authors'")
    assert dllm.generate(model, tok, ["hi"], "entropy_bound", steps=4, stop_early=False).stats.nfe <= 4
    (directory / "generation_config.json").write_text(json.dumps({"t_min": "cold"}))
    with pytest.raises(DllmError, match="t_min must be float, got 'cold' \\(from the model's generation_config"):
        dllm.generate(*dllm.load(str(directory)), ["hi"])
    (directory / "generation_config.json").write_text(json.dumps({"stability_threshold": -1}))
    with pytest.raises(DllmError, match=r"parameter stability=-1 is out of range; it must be >= 0 \(from the "
                                        r"model's generation_config.json: stability_threshold -1\)$"):
        dllm.generate(*dllm.load(str(directory)), ["hi"])  # the file's key, beside ours


def test_the_cli_generates_and_benches(capsys):
    """`dllm generate` and `dllm bench` on the random preset with the family's defaults (entropy_bound, block
    cache, 48 steps per canvas); the CLI's tokens are the Python call's."""
    assert main(["generate", "--model", "random:diffusion-gemma-tiny", "--gen-length", "32", "--json", "hi"]) == 0
    out = json.loads(capsys.readouterr().out)
    model, tok = dllm.load("random:diffusion-gemma-tiny")
    want = dllm.generate(model, tok, ["hi"], gen_length=32)
    assert out["sampler"]["name"] == "entropy_bound" and out["cache"]["name"] == "block"
    assert out["outputs"][0]["token_ids"] == want.token_ids[0] and out["stats"]["nfe"] == want.stats.nfe <= 96
    assert main(["bench", "--model", "random:diffusion-gemma-tiny", "--gen-length", "16", "--steps", "4",
                 "--repeats", "1", "--prompt-length", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["nfe"] == 4 and result["config"]["sampler"]["name"] == "entropy_bound"
    assert model.config.moe.top_k / model.config.moe.n_experts < result["model"]["experts_read"] <= 1


def test_bench_counts_the_experts_the_router_input_chose(quiet, monkeypatch):
    """DiffusionGemma routes on the residual stream, not on the experts' input: the bench's count routes what
    the layer routed."""
    from dllm.engine.bench import expert_fraction
    from dllm.models.moe import MoE

    routed, route = [], MoE.route
    monkeypatch.setattr(MoE, "route", lambda moe, x: routed.append(x) or route(moe, x))
    expert_fraction(quiet, PROMPTS[:1], EntropyBound(), CACHES.create("block"), 16, 2, 0)
    assert len(routed) % 2 == 0 and all(torch.equal(a, b) for a, b in zip(routed[::2], routed[1::2]))


def _generate_one(model, prompt, canvases, steps, rule, seed, stop_ids):
    """Our network and `entropy_bound_step` composed as transformers' `generate` runs one row: encode the prompt,
    denoise each canvas from random tokens (self-conditioned on the previous step), commit its argmax, encode
    it; stop after a canvas holding a stop id (what follows it in the canvas becomes pad)."""
    g, size, vocab = torch.Generator().manual_seed(seed), model.config.canvas_length, model.config.vocab_size
    columns, tokens = Columns(model, torch.ones(1, len(prompt) + canvases * size, dtype=torch.bool)), [list(prompt)]
    columns.run(torch.tensor(tokens), 0, False)
    for _ in range(canvases):
        start, sc = len(tokens[0]), None
        canvas = random_canvas((1, size), vocab, [g])
        history = new_history(rule.stability, canvas)
        for steps_left in range(steps, 0, -1):
            out = entropy_bound_step(columns.run(canvas, start, True, sc), canvas, history, steps_left, steps, rule,
                                     [g])
            canvas, history, sc = out.canvas, out.history, out.scaled
            if out.stop.all():
                break
        answer = out.argmax[0].tolist()
        end = next((i + 1 for i, t in enumerate(answer) if t in stop_ids), None)
        tokens[0] += answer if end is None else answer[:end] + [model.config.pad_id] * (size - end)
        if end is not None:
            break
        columns.run(out.argmax, start, False)
    return torch.tensor(tokens)


def _through_the_end_of_answer(ids, stop_ids):
    """The answer up to its first stop id, included (transformers pads what follows it; we write the filler)."""
    return ids[:next((i + 1 for i, t in enumerate(ids) if t in stop_ids), len(ids))]


@pytest.mark.parametrize(("stability", "confidence", "stop_ids"), [
    (1, 0.005, (1,)),  # three canvases of 12 steps each
    (0, 5.0, (1,)),  # the first canvas stops at its first step (mean entropy below ln 128 < 5) and holds a 1
    (1, 0.005, (7,)),  # the third canvas holds a 7: pad after it
])
def test_generation_replays_transformers_draws(pair, stability, confidence, stop_ids):
    """One row, the same seed: our pieces, and the decode loop with the entropy_bound sampler (the block cache
    encoding each committed canvas in the next one's first forward, and no cache), generate transformers' tokens
    exactly (its `generate` draws the batch's random numbers from one stream, so only a single row can replay
    them). Self-conditioning's output weights at transformers' initial scale (std 0.02): at the fixture's 0.1 it
    amplifies a logit difference 3-5x per step, so float32 rounding differences (2e-6 at a canvas's first step)
    reach 0.3 by the twelfth and flip a committed argmax; at 0.02 they stay below 2e-5."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    ref, model = (copy.deepcopy(m) for m in pair[:2])
    model.config = dataclasses.replace(model.config, stop_ids=stop_ids)
    with torch.no_grad():
        ref.model.decoder.self_conditioning.down_proj.weight.mul_(0.2)
        model.self_conditioning.mlp.down_proj.weight.mul_(0.2)
    steps, rule = 12, EntropyBound(stability=stability, confidence=confidence)
    torch.manual_seed(4)
    want = ref.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=48, max_denoising_steps=steps,
                        t_min=rule.t_min, t_max=rule.t_max, stability_threshold=rule.stability,
                        confidence_threshold=rule.confidence, sampler_config=EntropyBoundSamplerConfig(rule.bound),
                        eos_token_id=list(stop_ids), pad_token_id=model.config.pad_id)
    with torch.no_grad():
        got = _generate_one(model, PROMPTS[0], 3, steps, rule, 4, stop_ids)
    assert torch.equal(got, want.sequences)
    answer = _through_the_end_of_answer(want.sequences[0, len(PROMPTS[0]):].tolist(), stop_ids)
    for cache in ("block", "none"):
        canvas, stats, _ = decode(model, [PROMPTS[0]], rule, CACHES.create(cache), 48, 16, 3 * steps, seed=4)
        assert _through_the_end_of_answer(canvas.tokens[0, len(PROMPTS[0]):].tolist(), stop_ids) == answer, cache
        assert stats.gen_tokens == 16 * -(-len(answer) // 16)  # whole canvases committed


def test_an_image_is_refused_by_name():
    model = build_model(dataclasses.replace(PRESETS["diffusion-gemma-tiny"], image_token_id=100), "cpu", torch.float32)
    with pytest.raises(DllmError, match="image token 100.*text only"):
        Canvas.check(model, [[2, 5, 100, 6]], 16)


def test_served_with_the_family_defaults():
    """`dllm serve` takes the family's sampler and cache, keeps 48 steps per canvas for a shorter answer
    (max_tokens), and answers as `dllm.generate` does alone."""
    pytest.importorskip("fastapi")
    from dllm.cli import build_parser
    from dllm.cli.serving import serve_setup
    from dllm.serve import EngineClient, EngineSpec, LocalServer, post

    model, tok, defaults = serve_setup(build_parser().parse_args(["serve", "--model", "random:diffusion-gemma-tiny",
                                                                   "--gen-length", "32"]))
    assert (defaults["sampler"], defaults["cache"]) == ("entropy_bound", "block")
    want = dllm.generate(model, tok, "abc", chat=False, gen_length=16)
    with LocalServer(EngineClient.spawn(EngineSpec("random:diffusion-gemma-tiny"), defaults)) as local:
        status, answer = post(local.url + "/v1/completions", {"prompt": "abc", "max_tokens": 16})
    assert status == 200 and answer["choices"][0]["text"] == want.texts[0]
    assert want.stats.nfe == 48 and answer["usage"]["completion_tokens"] == len(want.token_ids[0])
