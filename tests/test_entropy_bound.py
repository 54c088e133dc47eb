"""DiffusionGemma's entropy-bound rule (`samplers/entropy_bound.py`) decides as transformers' reference does on
the same logits: the temperature schedule bit for bit, the kept and renoised positions, the stop of each row over
a run of steps, and (one row, the same seed) the very tokens drawn."""
import pytest
import torch
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
    EntropyBoundSampler,
    EntropyBoundSamplerConfig,
    LinearTemperatureScheduleLogitsProcessor,
    StableAndConfidentStoppingCriteria,
)

from dllm.core.errors import DllmError
from dllm.samplers.entropy_bound import (
    EntropyBound,
    entropy_bound_step,
    low_entropy_keep,
    new_history,
    random_canvas,
    stops,
    temperature,
    token_entropy,
)

VOCAB, CANVAS = 64, 16


def _logits(seed, batch=6):
    """Random logits whose rows range from flat to sharp, so that from one kept position to all are kept."""
    g = torch.Generator().manual_seed(seed)
    sharpness = torch.logspace(-1, 1.5, batch)[:, None, None]
    return torch.randn(batch, CANVAS, VOCAB, generator=g) * sharpness * torch.rand(batch, CANVAS, 1, generator=g) * 4


def test_temperature_schedule_equals_reference():
    reference = LinearTemperatureScheduleLogitsProcessor(t_min=0.4, t_max=0.8, max_denoising_steps=48)
    logits = _logits(0)
    for steps_left in (48, 47, 30, 2, 1):
        want = reference(None, logits, cur_step=torch.tensor(steps_left, dtype=torch.int32))
        assert torch.equal(logits / temperature(steps_left, 48, 0.4, 0.8), want)


@pytest.mark.parametrize("bound", [0.1, 1.0, 5.0])
def test_kept_positions_equal_reference(bound):
    reference = EntropyBoundSampler(EntropyBoundSamplerConfig(entropy_bound=bound), CANVAS, VOCAB, 48)
    kept_counts = set()
    for seed in range(5):
        scaled = _logits(seed) / 0.6
        current, denoised = (torch.randint(0, VOCAB, (6, CANVAS), generator=torch.Generator().manual_seed(s))
                             for s in (seed, seed + 100))
        accepted = reference.accept_canvas(current, denoised, scaled, cur_step=10)
        keep = low_entropy_keep(token_entropy(scaled), bound)
        assert torch.equal(keep, reference.accepted_token_mask)
        assert torch.equal(torch.where(keep, denoised, current), accepted)
        kept_counts |= set(keep.sum(1).tolist())
    assert min(kept_counts) >= 1 and len(kept_counts) > 3  # rows keep from few to many positions


@pytest.mark.parametrize("stability", [0, 1, 2])
def test_stops_equal_reference(stability):
    """Over a run where argmax canvases repeat and rows sharpen, each step's stop flags equal the reference's."""
    reference = StableAndConfidentStoppingCriteria(stability_threshold=stability, confidence_threshold=0.05)
    g = torch.Generator().manual_seed(stability)
    logits = _logits(7)
    history, stopped = None, 0
    for step in range(8):
        if step % 3 == 2:  # a new prediction now and then: stability starts over
            logits = logits + 3 * torch.randn(logits.shape, generator=g)
        scaled = logits * (1 + step)  # sharper every step: low-entropy rows become confident
        argmax = scaled.argmax(-1)
        history = new_history(stability, argmax) if history is None else history
        stop, history = stops(argmax, history, token_entropy(scaled), 0.05)
        want = reference(argmax, scaled)
        assert torch.equal(stop, want), step
        stopped += int(stop.sum())
    assert stopped > 0


def test_one_row_draws_equal_reference():
    """A row's fresh canvas, samples and renoised tokens equal transformers' draws from the same seed (one
    row: transformers draws for the whole batch from one stream, we per row)."""
    rule, steps = EntropyBound(bound=1.0), 48
    logits = _logits(3, batch=1) + 2.0
    reference = EntropyBoundSampler(EntropyBoundSamplerConfig(entropy_bound=1.0), CANVAS, VOCAB, steps)
    processor = LinearTemperatureScheduleLogitsProcessor(t_min=rule.t_min, t_max=rule.t_max,
                                                         max_denoising_steps=steps)
    torch.manual_seed(11)
    start = reference.initialize_canvas(1, torch.device("cpu"))
    scaled = processor(None, logits, cur_step=torch.tensor(40, dtype=torch.int32))
    drawn = torch.multinomial(torch.softmax(scaled, -1).view(-1, VOCAB), 1).view(1, CANVAS)
    want = reference.renoise_canvas(reference.accept_canvas(start, drawn, scaled, 40), 40)

    g = torch.Generator().manual_seed(11)
    canvas = random_canvas((1, CANVAS), VOCAB, [g])
    assert torch.equal(canvas, start)
    out = entropy_bound_step(logits, canvas, new_history(1, canvas), 40, steps, rule, [g])
    assert torch.equal(out.canvas, want) and torch.equal(out.scaled, scaled)
    assert 0 < out.keep.sum() < CANVAS and torch.equal(out.keep, reference.accepted_token_mask)


def test_a_stopped_row_draws_nothing():
    rule = EntropyBound()
    logits, canvas = _logits(1, batch=2), torch.zeros(2, CANVAS, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    out = entropy_bound_step(logits, canvas, new_history(1, canvas), 48, 48, rule, [None, g])
    alone = entropy_bound_step(logits[1:], canvas[1:], new_history(1, canvas[1:]), 48, 48, rule,
                               [torch.Generator().manual_seed(0)])
    assert torch.equal(out.canvas[0], canvas[0]) and torch.equal(out.canvas[1:], alone.canvas)


def test_bad_parameters():
    with pytest.raises(DllmError, match="t_max > t_min"):
        EntropyBound(t_max=0.3)
    with pytest.raises(DllmError, match="bound"):
        EntropyBound(bound=0)
