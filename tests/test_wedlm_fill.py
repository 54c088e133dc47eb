"""WeDLM's fill rule (samplers/wedlm.py, spec `wedlm.md` 2.3) on hand-computed cases: entropy plus the distance
penalty strictly below the threshold, else the single lowest score; the authors' dtype quirks."""
import math

import pytest
import torch

from dllm.samplers.wedlm import ENTROPY_THRESHOLD, POS_PENALTY, WINDOW_SIZE, greedy_tokens, logits_dtype_entropy, \
    wedlm_fills

INF = float("inf")
COIN = [0.0, 0.0, -INF, -INF]  # entropy ln 2 = 0.693
SURE = [0.0, -INF, -INF, -INF]  # entropy 0


def fills(rows, positions, eligible=None, **params):
    logits = torch.tensor([rows])
    positions = torch.tensor([positions])
    eligible = torch.ones_like(positions, dtype=torch.bool) if eligible is None else torch.tensor([eligible])
    chosen = wedlm_fills(logits, eligible, positions, **params)[0]
    return positions[0][chosen].tolist()


def test_the_authors_defaults():
    assert (WINDOW_SIZE, ENTROPY_THRESHOLD, POS_PENALTY) == (16, 0.4, 0.02)


def test_entropies_of_the_cases():
    assert logits_dtype_entropy(torch.tensor([COIN, SURE])).tolist() == pytest.approx([math.log(2), 0.0])


@pytest.mark.parametrize("penalty,threshold,want", [
    (0.02, 0.4, [6, 8]),  # scores 0.693, 0.02, 0.733, 0.06
    (0.2, 0.4, [6]),  # scores 0.693, 0.2, 1.093, 0.6
    (0.02, None, [6]),  # one fill: the lowest score
    (0.02, 0.0, [6]),  # nothing is below 0: the lowest score
    (0.02, 1e9, [5, 6, 7, 8]),  # every mask
])
def test_threshold_and_penalty(penalty, threshold, want):
    assert fills([COIN, SURE, COIN, SURE], [5, 6, 7, 8], pos_penalty=penalty, entropy_threshold=threshold) == want


def test_without_a_score_below_the_threshold_the_nearest_of_equal_entropies_is_filled():
    assert fills([COIN, COIN, COIN], [5, 6, 7]) == [5]  # 0.693, 0.713, 0.733
    assert fills([COIN, COIN, COIN], [5, 6, 7], pos_penalty=0.0) == [5]  # a tie: the first candidate


def test_the_threshold_is_strict():
    assert fills([SURE, SURE], [5, 9], pos_penalty=0.1, entropy_threshold=0.4) == [5]  # 0.1 * 4 is not < 0.4
    assert fills([SURE, SURE], [5, 9], pos_penalty=0.1, entropy_threshold=0.41) == [5, 9]


def test_distance_counts_from_the_first_eligible_mask_and_only_eligible_masks_fill():
    assert fills([SURE, COIN, SURE, COIN], [5, 6, 8, 9], eligible=[False, True, True, True],
                 pos_penalty=0.3) == [8]  # 0.693, 0.6, 1.593 from position 6; position 5 (score 0) is not a mask
    assert fills([SURE, SURE], [5, 6], eligible=[False, False]) == []


def test_per_row_parameters_equal_each_row_alone():
    """Stacked per-row values (`stack_rows`: a None threshold is NaN) decide each row as its own numbers do."""
    rows = [[COIN, SURE, COIN, SURE], [SURE, SURE, COIN, SURE]]
    positions, eligible = torch.tensor([[5, 6, 7, 8], [3, 4, 5, 6]]), torch.ones(2, 4, dtype=torch.bool)
    settings = [(0.4, 0.02), (None, 0.2)]
    together = wedlm_fills(torch.tensor(rows), eligible, positions,
                           torch.tensor([math.nan if t is None else t for t, _ in settings]),
                           torch.tensor([p for _, p in settings]))
    for i, (threshold, penalty) in enumerate(settings):
        alone = wedlm_fills(torch.tensor(rows[i:i + 1]), eligible[i:i + 1], positions[i:i + 1], threshold, penalty)
        assert torch.equal(together[i:i + 1], alone)
    assert together.sum(1).tolist() == [2, 1]


def test_the_entropy_is_computed_in_the_logits_dtype():
    """bf16 logits are scored with the bf16 entropy, as the authors' engine does on its bf16 checkpoints: a peaked
    row whose float32 entropy is below the threshold and whose bf16 entropy is not (found among seeded rows)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(2000):
        logits = (torch.randn(1, 1, 1000, generator=g) * 3).to(torch.bfloat16)
        logits[0, 0, 0] += 18
        exact, rounded = logits_dtype_entropy(logits.float()).item(), logits_dtype_entropy(logits).item()
        threshold = (exact + rounded) / 2
        if abs(exact - rounded) > 0.01:
            break
    else:
        pytest.fail("no row tells the dtypes apart")
    eligible, positions = torch.ones(1, 2, dtype=torch.bool), torch.tensor([[0, 1]])
    sure = torch.full_like(logits, -INF)
    sure[..., 0] = 0.0
    pair = torch.cat((sure, logits), 1)  # a certain mask first: the rule never falls back to the lowest score
    for given, entropy in ((pair, rounded), (pair.float(), exact)):
        assert wedlm_fills(given, eligible, positions, threshold, 0.0).tolist() == [[True, entropy < threshold]]
    assert (rounded < threshold) != (exact < threshold)


def test_greedy_token_ties_after_bf16_rounding_go_to_the_lower_id():
    logits = torch.full((1, 1, 100), -1.0, dtype=torch.bfloat16)
    logits[0, 0, 7], logits[0, 0, 3] = 0.0, -2 ** -9  # distinct logits, equal bf16 probabilities
    assert (greedy_tokens(logits).item(), logits.argmax(-1).item(), greedy_tokens(logits.float()).item()) == (3, 7, 7)
