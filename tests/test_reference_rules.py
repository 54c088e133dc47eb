"""Selection rules against plain per-row transcriptions of the reference code (issue #14).

Each rule below is a deliberately naive per-row loop (the reference function step by step, or the spec's
formula); the sampler must pick exactly the same positions on thousands of random steps, edge cases included
(0-3 masks left, confidences on or one ulp under a bar, tied confidences, confidences that round to 1.0)."""
from types import SimpleNamespace

import pytest
import torch

from dllm import samplers
from dllm.samplers import StepContext
from dllm.samplers.base import token_probability
from dllm.samplers.fastdllm import factor_count

C, V = 8, 5  # candidate positions per row, vocabulary


def reference_factor(conf, eligible, factor):
    """NVlabs/Fast-dLLM `get_transfer_index_dynamic` (v1/llada/generate.py), one row: bars 1 - f/(n+1) for
    ranks n = 1..N except rank 1 (bar -1), scan the sorted confidences up to the first rank under its bar, and
    bump the loop index when it stopped on the first or the last rank."""
    masked = [i for i in range(len(conf)) if eligible[i]]
    if not masked:  # the reference skips rows with no mask
        return set()
    bars = [1 - factor / (n + 1) for n in range(1, len(masked) + 1)]
    bars[0] = -1
    ranked = sorted((conf[i] for i in masked), reverse=True)
    for top_i in range(len(bars)):
        if ranked[top_i] < bars[top_i]:
            break
    if top_i == 0 or top_i == len(bars) - 1:
        top_i += 1
    # top-k of the row; torch.topk leaves the order of ties unspecified, the toolkit takes the lowest position
    return set(sorted(masked, key=lambda i: (-conf[i], i))[:top_i])


def spec_factor(conf, eligible, factor):
    """Spec 3.2 clean rule: the top n* = max(1, #{n : c_(n) >= 1 - f/(n+1)})."""
    masked = sorted((i for i in range(len(conf)) if eligible[i]), key=lambda i: (-conf[i], i))
    n_star = sum(conf[i] >= 1 - factor / (n + 1) for n, i in enumerate(masked, start=1))
    return set(masked[:max(1, n_star)]) if masked else set()


def random_step(rows, factor, seed):
    """Logits for `rows` independent steps; confidences uniform, on a bar, tied, or exactly 1.0."""
    g = torch.Generator().manual_seed(seed)
    u = lambda *shape: torch.rand(shape, dtype=torch.float64, generator=g)  # noqa: E731
    c = u(rows, C)
    bars = 1 - factor / (torch.randint(1, C + 1, (rows, C), generator=g) + 1.0)
    kind = u(rows, C)
    c = torch.where(kind < 0.2, bars.clamp(0, 1), c)
    c = torch.where((kind >= 0.2) & (kind < 0.3), torch.ones_like(c), c)
    c = torch.where((kind >= 0.3) & (kind < 0.5), c[:, :1], c)  # ties with the row's first position
    c = torch.where(u(rows, 1) < 0.1, (c * 4).round() / 4, c)  # some rows on a coarse grid: many ties
    probs = torch.cat([c[..., None], ((1 - c) / (V - 1))[..., None].expand(rows, C, V - 1)], -1)
    # masks left: mostly 1, 2 or 3, sometimes any count, rarely none (finished row)
    left = torch.randint(1, 4, (rows,), generator=g)
    left = torch.where(u(rows) < 0.3, torch.randint(0, C + 1, (rows,), generator=g), left)
    order = torch.rand(rows, C, generator=g).argsort(1)
    eligible = torch.zeros(rows, C, dtype=torch.bool).scatter(1, order, torch.arange(C)[None] < left[:, None])
    return probs.log(), eligible


def mismatches(rule, factor, compat, rows=4000, seed=0):
    logits, eligible = random_step(rows, factor, seed)
    ctx = StepContext(logits, eligible, eligible.clone(), torch.arange(C), torch.zeros(rows, C, dtype=torch.long),
                      0, 1, 0, [torch.Generator().manual_seed(0)] * rows, 0, 1, 0, C, 0, SimpleNamespace())
    ours = samplers.SAMPLERS.create("factor", factor=factor, compat=compat).step(ctx).mask
    conf = token_probability(logits, logits.argmax(-1)).double().tolist()  # the sampler's own confidences
    return sum({i for i in range(C) if ours[b, i]} != rule(conf[b], eligible[b].tolist(), factor)
               for b in range(rows))


@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0])
def test_factor_compat_equals_the_reference_rule(factor):
    assert mismatches(reference_factor, factor, compat=True) == 0


@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0])
def test_factor_default_equals_the_spec_rule(factor):
    assert mismatches(spec_factor, factor, compat=False) == 0


@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("compat", [False, True])
def test_factor_count_at_the_bars(factor, compat):
    """Confidences exactly on a bar, one ulp under it (the >= / < boundary), or uniform, fed straight to the
    count."""
    g = torch.Generator().manual_seed(1)
    rows = 3000
    c = 1 - factor / (torch.randint(1, C + 1, (rows, C), generator=g) + 1.0)
    kind = torch.rand(rows, C, generator=g)
    c = torch.where(kind < 0.3, c.nextafter(torch.zeros_like(c)), c)
    c = torch.where(kind > 0.7, torch.rand(rows, C, dtype=torch.float64, generator=g), c).clamp(min=0)
    left = torch.randint(0, C + 1, (rows,), generator=g)
    left = torch.where(torch.rand(rows, generator=g) < 0.5, torch.randint(1, 4, (rows,), generator=g), left)
    ranked = c.masked_fill(torch.arange(C)[None] >= left[:, None], float("-inf")).sort(1, descending=True).values
    ours = factor_count(ranked, left, factor, compat).tolist()
    rule = reference_factor if compat else spec_factor
    want = [len(rule(row, [i < k for i in range(C)], factor)) for row, k in zip(ranked.tolist(), left.tolist())]
    assert sum(a != b for a, b in zip(ours, want)) == 0


def reference_dynamic(conf, eligible, scheduled, threshold):
    """JetAstra/SDAR `generate.py` `low_confidence_dynamic`, one row: every masked position above the threshold
    when there are at least the step's scheduled count of them, else the scheduled count of the most confident
    (the toolkit breaks ties towards the lowest position)."""
    masked = [i for i in range(len(conf)) if eligible[i]]
    high = {i for i in masked if conf[i] > threshold}
    if len(high) >= scheduled:
        return high
    return set(sorted(masked, key=lambda i: (-conf[i], i))[:scheduled])


@pytest.mark.parametrize("steps", [1, 2, 3, 8])
@pytest.mark.parametrize("threshold", [0.5, 0.85])
def test_low_confidence_dynamic_equals_sdars_rule(steps, threshold):
    """At every step of the schedule (the block split evenly, larger shares first), on steps where the scheduled
    count is at least 1 and at most the masks left (outside those, SDAR's top-k would commit no position, or
    positions already decoded; the toolkit commits one, or what is left)."""
    logits, eligible = random_step(4000, 1.0, seed=steps)
    conf = token_probability(logits, logits.argmax(-1)).double().tolist()
    checked = 0
    for step in range(steps):
        scheduled = C // steps + int(step < C % steps)
        ctx = StepContext(logits, eligible, eligible.clone(), torch.arange(C), torch.zeros(4000, C, dtype=torch.long),
                          step, steps, 0, [None] * 4000, 0, steps, 0, C, 0, SimpleNamespace())
        ours = samplers.SAMPLERS.create("low_confidence_dynamic", threshold=threshold).step(ctx).mask
        for b in range(4000):
            left = int(eligible[b].sum())
            if 1 <= scheduled <= left:
                checked += 1
                assert {i for i in range(C) if ours[b, i]} == reference_dynamic(conf[b], eligible[b].tolist(),
                                                                                   scheduled, threshold)
    assert checked >= 100  # rows where the rule applies (many masks left are rarer in random_step)


def reference_entropy_bounded(probs: torch.Tensor, eligible: list[bool], bound: float) -> set[int]:
    """JetAstra's engine, `entropy_bounded`, one row: the masked positions sorted by entropy (ascending), the
    count k = searchsorted(cumsum, bound) (left), at least 1."""
    masked = [i for i in range(len(eligible)) if eligible[i]]
    p = probs[masked].clamp_min(1e-12)
    entropies = -(p * p.log()).sum(-1)
    ent_sorted, order = torch.sort(entropies, stable=True)
    k = max(int(torch.searchsorted(ent_sorted.cumsum(0), torch.tensor(bound, dtype=ent_sorted.dtype))), 1)
    return {masked[int(j)] for j in order[:k]}


@pytest.mark.parametrize("bound", [0.35, 2.0])
def test_entropy_bounded_equals_the_reference_rule(bound):
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(500, C, V, generator=g) * torch.rand(500, C, 1, generator=g) * 12
    eligible = torch.rand(500, C, generator=g) < 0.6
    eligible[:, 0] = True
    ctx = StepContext(logits, eligible, eligible.clone(), torch.arange(C), torch.zeros(500, C, dtype=torch.long),
                      0, 4, 0, [None] * 500, 0, 4, 0, C, 0, SimpleNamespace())
    ours = samplers.SAMPLERS.create("entropy_bounded", bound=bound).step(ctx).mask
    probs = logits.double().softmax(-1)
    counts = set()
    for b in range(500):
        want = reference_entropy_bounded(probs[b], eligible[b].tolist(), bound)
        assert {i for i in range(C) if ours[b, i]} == want
        counts.add(len(want))
    assert len(counts) > 2  # the bound chose different counts


def test_sub_block_commits_only_in_the_leftmost_open_sub_block():
    """Fast-dLLM v2: after a block's first step, inside the leftmost sub-block with masks, every position above
    the threshold (strictly: `x1_p > threshold`) and the most confident one; nothing in later sub-blocks. At a
    block's first step, a block that starts with a mask commits that position alone (the autoregressive step);
    one that the prompt ends in (v2: a prompt not a multiple of the block) takes the sub-block rule at once."""
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(300, C, V, generator=g) * 6
    logits[:5] = 0.0  # every probability exactly 1 / V: on the bar
    eligible = torch.rand(300, C, generator=g) < 0.5
    eligible[:, -1] = True
    ctx = StepContext(logits, eligible, eligible.clone(), torch.arange(C), torch.zeros(300, C, dtype=torch.long),
                      1, 4, 0, [None] * 300, 0, 4, 0, C, 0, SimpleNamespace())
    threshold = token_probability(logits[:1, :1], torch.zeros(1, 1, dtype=torch.long)).item()  # 1 / V
    ours = samplers.SAMPLERS.create("sub_block", sub_block=3, threshold=threshold).step(ctx).mask
    ctx.step = 0
    first = samplers.SAMPLERS.create("sub_block", sub_block=3, threshold=threshold).step(ctx).mask
    starts = eligible[:, 0]
    assert torch.equal(first[starts], (eligible & (eligible.cumsum(1) == 1))[starts])
    assert torch.equal(first[~starts], ours[~starts]) and (~starts).sum() > 100
    conf = token_probability(logits, logits.argmax(-1))
    for b in range(300):
        first = int(eligible[b].nonzero()[0]) // 3
        current = [i for i in range(C) if eligible[b, i] and i // 3 == first]
        best = max(current, key=lambda i: (conf[b, i], -i))
        assert {i for i in range(C) if ours[b, i]} == {i for i in current if conf[b, i] > threshold} | {best}


@pytest.mark.parametrize("name", ["low_confidence_dynamic", "sub_block"])
def test_sampled_tokens_are_scored_by_the_tempered_distribution(name):
    """SDAR and Fast-dLLM v2 draw at T > 0 from softmax(logits / T) and score the drawn token by its
    probability there (SDAR `sample_with_temperature_topk_topp`, v2 `sample_with_top_p`)."""
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(4, C, V, generator=g) * 3
    eligible = torch.ones(4, C, dtype=torch.bool)
    ctx = StepContext(logits, eligible, eligible.clone(), torch.arange(C), torch.zeros(4, C, dtype=torch.long),
                      1, 4, 0, [torch.Generator().manual_seed(b) for b in range(4)], 0, 4, 0, C, 0, SimpleNamespace())
    out = samplers.SAMPLERS.create(name, temperature=0.5).step(ctx)
    want = (logits / 0.5).double().softmax(-1).gather(-1, out.tokens[..., None])[..., 0]
    assert torch.allclose(out.confidence.double(), want, rtol=1e-5)


def near_tied_logits(rows: int, seed: int) -> torch.Tensor:
    """Logits of a vocabulary of 500 whose best candidates sit within a few fp32 ulps of each other (the logit
    scale of a sharp model: LLaDA's head scaled by 30), or saturate to probability 1."""
    g = torch.Generator().manual_seed(seed)
    logits = 30 * torch.randn(rows, C, 500, generator=g)
    top = logits.amax(-1, keepdim=True)
    near = torch.rand(rows, C, 1, generator=g) < 0.5
    return torch.where(near & (torch.rand(rows, C, 500, generator=g) < 0.01), top - 1e-5 * torch.rand(
        rows, C, 500, generator=g), logits)


def llada_confidence(logits, x0):
    """ML-GSAI/LLaDA `generate.py` (low_confidence): `p = F.softmax(logits, dim=-1)`, gathered at `x0`; the logits
    are fp32 here as in every CPU test (bf16 on its GPUs)."""
    p = torch.nn.functional.softmax(logits, dim=-1)
    return torch.squeeze(torch.gather(p, dim=-1, index=torch.unsqueeze(x0, -1)), -1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_token_probability_is_the_references_softmax_then_gather(seed):
    """Bit for bit: near-tied confidences then order as the reference's do (issue #34: exp(logit - logsumexp)
    rounded differently and swapped near-tied positions in 2 of 10 answers of a sharp model)."""
    logits = near_tied_logits(200, seed)
    x0 = logits.argmax(-1)
    ours, theirs = token_probability(logits, x0), llada_confidence(logits, x0)
    assert torch.equal(ours, theirs)
    old_rule = (logits.gather(-1, x0[..., None])[..., 0] - logits.logsumexp(-1)).exp()
    assert not torch.equal(old_rule, theirs)  # the rule this replaced rounds otherwise on these logits


def test_low_confidence_picks_what_llada_picks_on_near_ties():
    """One step of low_confidence against the reference's top-k of those confidences, on rows with exact and
    near ties; exact ties go to the lowest position (the reference's `torch.topk` leaves their order to the
    implementation: with torch 2.13 on a CPU, `topk([-inf, -inf, -inf, 1, -inf, -inf, -inf, 1], 1)` returns
    position 7, and the order of ties changes with the vector's length)."""
    logits = near_tied_logits(400, 3)
    g = torch.Generator().manual_seed(4)
    eligible = torch.rand(400, C, generator=g) < 0.7
    eligible[:, 0] = True
    for steps in (1, 2, 4):
        ctx = StepContext(logits, eligible, eligible.clone(), torch.arange(C), torch.zeros(400, C, dtype=torch.long),
                          0, steps, 0, [None] * 400, 0, steps, 0, C, 0, SimpleNamespace())
        ours = samplers.SAMPLERS.create("low_confidence").step(ctx).mask
        confidence = torch.where(eligible, llada_confidence(logits, logits.argmax(-1)), float("-inf"))
        for b in range(400):
            k = -(-int(eligible[b].sum()) // steps)
            chosen = sorted(range(C), key=lambda i: (-confidence[b, i].item(), i))[:k]
            assert {i for i in range(C) if ours[b, i]} == set(chosen)
