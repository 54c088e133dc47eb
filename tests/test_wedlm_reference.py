"""The transcription of WeDLM's engine loop (tests/wedlm_reference.py) on cases whose answer is known: a stand-in
network that predicts a fixed text with chosen certainty gives the fill schedule the rule implies; on a random
Qwen3-shaped WeDLM a window of 1, or a penalty that always picks the first mask, is the autoregressive decoder whose
every token comes from a mask row; and the loop equals the canvas form of spec section 2.7 (the rank rule over the
unreordered canvas, the fill rule of samplers/wedlm.py), token for token and step for step, one forward fewer."""
from types import SimpleNamespace

import pytest
import torch
from wedlm_reference import wedlm_reference

from dllm.models import PRESETS
from dllm.models.loading import build_model, init_random
from dllm.models.transformer import visible_keys
from dllm.samplers.wedlm import greedy_tokens, wedlm_fills

VOCAB, MASK, STOP = 16, 15, 14
PROMPT = [1, 2, 3]
TEXT = [(3 * i + 4) % 14 for i in range(64)]  # never the mask or the stop


class StandIn(torch.nn.Module):
    """A mask row at answer position i predicts `text[i]`: sure (logit 30, entropy ~1e-10) or unsure (logit 1 over
    16 tokens, entropy 2.55) as `sure(i)` says, whatever it sees. Other rows predict nothing (zeros)."""

    def __init__(self, text=TEXT, sure=lambda i: True):
        super().__init__()
        self.config = SimpleNamespace(mask_id=MASK)
        self.text, self.sure = text, sure

    def run(self, tokens, positions, key_mask):
        logits = torch.zeros(*tokens.shape, VOCAB)
        for b, r in (tokens == MASK).nonzero().tolist():
            i = int(positions[b, r]) - len(PROMPT)
            logits[b, r, self.text[i]] = 30.0 if self.sure(i) else 1.0
        return logits


def test_sure_masks_fill_the_whole_window_each_step():
    """W = 4, every mask sure: the first forward fills 4 masks, each later one commits them (W + p = 8 rows) and
    fills the next 4; the 8th token is committed by the 3rd forward."""
    t = wedlm_reference(StandIn(), PROMPT, window_size=4, max_tokens=8)
    assert t.tokens == TEXT[:8]
    assert (t.forwards, t.rows, t.engine_decode_forwards, t.decode_tokens) == (3, [4, 8, 8], 2, 8)
    assert [[i for i, _ in step] for step in t.fills] == [[0, 1, 2, 3], [4, 5, 6, 7], []]


def test_unsure_masks_fill_one_a_step_nearest_first():
    t = wedlm_reference(StandIn(sure=lambda i: False), PROMPT, window_size=4, max_tokens=5)
    assert t.tokens == TEXT[:5]
    assert t.forwards == 6 and t.rows == [4, 5, 5, 5, 5, 5]
    assert [[i for i, _ in step] for step in t.fills] == [[0], [1], [2], [3], [4], []]


def test_the_distance_penalty_limits_the_fills():
    """lambda 0.1, tau 0.35: sure masks at distances 0-3 score below tau (0.3 < 0.35), distance 4 does not."""
    t = wedlm_reference(StandIn(), PROMPT, window_size=8, entropy_threshold=0.35, pos_penalty=0.1, max_tokens=8)
    assert [[i for i, _ in step] for step in t.fills] == [[0, 1, 2, 3], [4, 5, 6, 7], []]
    assert t.rows == [8, 12, 12]  # the refill before the forward: W + p rows


def test_an_unsure_first_mask_waits_for_a_later_sure_one():
    """Answer position 0 unsure, the rest sure: position 0 is passed over (score 2.55) while 1-3 fill; the next
    step has no leading filled run (no refill: 4 rows) and fills it alone as the lowest score; nothing is committed
    before it."""
    t = wedlm_reference(StandIn(sure=lambda i: i != 0), PROMPT, window_size=4, max_tokens=4)
    assert [[i for i, _ in step] for step in t.fills] == [[1, 2, 3], [0], []]
    assert t.tokens == TEXT[:4] and t.rows == [4, 4, 8]


def test_max_tokens_below_the_window():
    """max_tokens 3 < W 4: the 4th mask is filled too (nothing clips the window); the answer is cut at 3 tokens,
    while the engine's decode_tokens counts the whole committed run of 4."""
    t = wedlm_reference(StandIn(), PROMPT, window_size=4, max_tokens=3)
    assert t.tokens == TEXT[:3] and t.fills[0] == [(i, TEXT[i]) for i in range(4)]
    assert (t.forwards, t.decode_tokens) == (2, 4)


def test_a_stop_ends_the_answer_in_the_forward_that_commits_it():
    """The stop at answer position 2 is filled in the first forward with the token after it; the answer (stop
    kept) comes out of the second, the token after the stop never."""
    text = TEXT[:2] + [STOP] + TEXT[3:]
    t = wedlm_reference(StandIn(text), PROMPT, window_size=4, max_tokens=16, stop_ids=(STOP,))
    assert t.tokens == text[:3] and t.fills[0] == [(i, text[i]) for i in range(4)]
    assert (t.forwards, t.decode_tokens) == (2, 3)


def test_a_predicted_mask_id_is_a_filled_token():
    text = TEXT[:1] + [MASK] + TEXT[2:]
    t = wedlm_reference(StandIn(text), PROMPT, window_size=4, max_tokens=4)
    assert t.tokens == text[:4] and t.forwards == 2


# -- a random Qwen3-shaped WeDLM ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    """random:wedlm-tiny in float64 (float32 differences between two forms of one forward can flip `< tau`)."""
    model = build_model(PRESETS["wedlm-tiny"], "cpu", torch.float64)
    init_random(model, 1, std=0.2)
    return model.eval()


RANDOM_PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]


@torch.no_grad()
def mask_row_decoder(model, prompt: list[int], n: int) -> list[int]:
    """Autoregressive greedy decoding whose every token comes from a mask row: token i is the argmax of the row of a
    mask placed after the prompt and tokens < i (the first answer token included: the prompt's rows are unused)."""
    ids = list(prompt)
    for _ in range(n):
        x = ids + [model.config.mask_id]
        causal = torch.ones(len(x), len(x), dtype=torch.bool).tril()[None, None]
        logits = model.run(torch.tensor([x]), torch.arange(len(x))[None], causal)
        ids.append(int(greedy_tokens(logits[:, -1:])))
    return ids[len(prompt):]


@pytest.mark.parametrize("prompt", RANDOM_PROMPTS)
def test_a_window_of_one_is_the_mask_row_decoder(model, prompt):
    """W = 1 (any tau, lambda): one token committed per forward after the first."""
    want = mask_row_decoder(model, prompt, 12)
    for tau, lam in ((0.4, 0.02), (None, 0.0), (1e9, 1.0)):
        t = wedlm_reference(model, prompt, window_size=1, entropy_threshold=tau, pos_penalty=lam, max_tokens=12)
        assert t.tokens == want and t.forwards == 13


@pytest.mark.parametrize("prompt", RANDOM_PROMPTS)
def test_a_single_fill_at_the_first_mask_is_the_mask_row_decoder(model, prompt):
    """tau None and a penalty larger than any entropy: each step fills the window's first mask, which sees the
    prompt and every token before it and no mask but itself."""
    want = mask_row_decoder(model, prompt, 12)
    for window in (2, 4, 16):
        t = wedlm_reference(model, prompt, window_size=window, entropy_threshold=None, pos_penalty=100.0,
                            max_tokens=12)
        assert t.tokens == want and t.forwards == 13


@torch.no_grad()
def canvas_decode(model, prompt: list[int], window_size: int, entropy_threshold, pos_penalty: float,
                  max_tokens: int, stop_ids: tuple[int, ...]):
    """Spec section 2.7: the canvas `prompt + (max_tokens + W - 1)` masks and a filled flag per slot; each step the
    whole canvas is computed under the rank rule (filled slots rank before masks, RoPE at the canvas positions), the
    fill rule chooses among the masks of [f, f + W), f the first unfilled answer slot; the row is done, without a
    forward, once a stop lies before f or max_tokens slots are filled. Returns the answer, forwards and fills."""
    start, length = len(prompt), len(prompt) + max_tokens + window_size - 1
    tokens = torch.tensor([prompt + [model.config.mask_id] * (length - start)])
    unfilled = torch.arange(length)[None] >= start
    positions = torch.arange(length)[None]
    fills = []
    while True:
        first = int(unfilled[0].int().argmax()) if unfilled.any() else length
        answer = tokens[0, start:first].tolist()
        stops = [i for i, token in enumerate(answer) if token in stop_ids]
        if stops or first - start >= max_tokens:
            return (answer[:stops[0] + 1] if stops else answer[:max_tokens]), len(fills), fills
        ranks = positions + length * unfilled
        logits = model.run(tokens, positions, visible_keys(model.config, ranks, ranks, None))
        eligible = unfilled & (positions >= first) & (positions < first + window_size)
        chosen = wedlm_fills(logits, eligible, positions, entropy_threshold, pos_penalty)
        tokens = torch.where(chosen, greedy_tokens(logits), tokens)
        unfilled &= ~chosen
        fills.append([(i - start, int(tokens[0, i])) for i in chosen[0].nonzero()[:, 0].tolist()])


SETTINGS = [(w, tau, lam, n) for w in (1, 2, 4, 16)  # the random model's entropies are 3.9-4.2 nats
            for tau, lam in ((None, 0.0), (0.4, 0.02), (4.05, 0.0), (4.1, 0.01), (4.3, 0.05), (1e9, 1.0))
            for n in (3, w, 20)]


@pytest.mark.parametrize("prompt", RANDOM_PROMPTS)
def test_the_canvas_form_equals_the_engine_loop(model, prompt):
    """Every (W, tau, lambda, max_tokens) of SETTINGS, and once more with a stop id the answer holds mid-window: the
    same answer, the same fills at every step, one forward fewer (the engine's commit-only last forward)."""
    filled_many = 0
    for w, tau, lam, n in SETTINGS:
        t = wedlm_reference(model, prompt, w, tau, lam, n)
        stop = t.tokens[min(2, len(t.tokens) - 1)]
        for stop_ids in ((), (stop,)):
            t = wedlm_reference(model, prompt, w, tau, lam, n, stop_ids)
            answer, forwards, fills = canvas_decode(model, prompt, w, tau, lam, n, stop_ids)
            assert (answer, forwards, fills) == (t.tokens, t.forwards - 1, t.fills[:-1]), (w, tau, lam, n, stop_ids)
            filled_many += max(map(len, fills)) > 1
    assert filled_many > len(SETTINGS) // 2  # parallel fills, not only one a step


def test_the_loop_with_blocks_of_one_is_a_window_of_one(model):
    """What the loop already decodes on a causal model (blocks of one position, the exact block cache; the training
    script's periodic check) is the authors' loop with W = 1, a batch of unequal prompts at once."""
    import dllm

    tok = dllm.load("random:wedlm-tiny")[1]
    got = dllm.generate(model, tok, RANDOM_PROMPTS, sampler="low_confidence", gen_length=12, block_length=1)
    for prompt, ids in zip(RANDOM_PROMPTS, got.token_ids):
        want = wedlm_reference(model, prompt, window_size=1, max_tokens=12, stop_ids=model.config.stop_ids).tokens
        assert ids == [t for t in want if t not in model.config.stop_ids]  # the loop's answers end before a stop
