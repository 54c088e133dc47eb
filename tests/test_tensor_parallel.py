"""Tensor parallel on two gloo ranks (issue #48, spec `parallel_and_engine.md` part A): each sharded layer against its
dense twin, the samplers' statistics merged from vocabulary slices against the whole logits, tensor parallel 2
committing the tokens of one process for every sampler, cache and family (or the same refusal), the ranks' canvas
check, and a killed rank ending the run in one line.

One group of two ranks serves the module (`parallel.ranks`, this process rank 0, one thread each); a model is
sharded from a whole random one each rank builds alike (`loading.parallel_copy`), so its logits are as sharp as the
other tests' models. The functions each rank runs (`everywhere`) are this module's: rank 1 imports it by name."""
import functools
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, random_model
from test_row_params import PRESET, SHARED

import dllm
from dllm import cache as caches
from dllm import samplers
from dllm.core.errors import DllmError
from dllm.engine import Batch
from dllm.engine.decoding import new_batch
from dllm.engine.options import LoopOptions
from dllm.models import PRESETS, parallel
from dllm.models.loading import parallel_copy
from dllm.models.sharded_logits import ShardedLogits, full_logits, vocabulary_view
from dllm.models.sharding import Shard
from dllm.samplers.base import gumbel_argmax, token_entropy, token_probability

pytestmark = pytest.mark.distributed
SIZE = 2
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19]]  # left padding: rows of three lengths
GEN, BLOCK = 16, 8
TINY_PRESETS = [name for name in PRESETS if name.endswith("-tiny")]


@pytest.fixture(scope="module", autouse=True)
def group():
    """The module's two ranks (rank 1 imports this module by name: the tests' folder on its path)."""
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    return parallel.ranks(SIZE, torch.device("cpu"))


def everywhere(fn, *args):
    """`fn(*args)` on every rank (the other ranks get their own of rank 0's shared objects); rank 0's result."""
    parallel.RANKS.send(fn, *args)
    return fn(*args)


def build(preset: str, std: float = 0.2) -> torch.nn.Module:
    """The tests' random model of `preset` (DiffusionGemma's self-conditioning at transformers' initial scale, as in
    test_row_params: float32 rounding differences stay far below what flips a sample)."""
    model = random_model(preset, std=std)
    if PRESETS[preset].arch == "diffusion_gemma":
        with torch.no_grad():
            model.self_conditioning.mlp.down_proj.weight.mul_(0.2)
    return model


@functools.cache
def models(preset: str):
    """`preset`'s random model whole and split over the ranks."""
    return build(preset), parallel_copy(functools.partial(build, preset), SIZE)


# -- each sharded layer against its dense twin ---------------------------------------------------------------------
@torch.no_grad()
def layer_outputs(model, ids: torch.Tensor, x: torch.Tensor, o: torch.Tensor, soft: torch.Tensor
                  ) -> dict[str, torch.Tensor]:
    """The embedding of `ids`, the logits (after logits `soft` of a previous step: self-conditioning), each layer's
    attention output of `o` `[B, H, A, D]` (a rank: its heads) and feed-forward of `x`, whole on every rank."""
    positions = torch.arange(ids.shape[1]).expand(len(ids), -1)
    conditioned = {"self_conditioning": soft} if hasattr(model, "soft_embedding") else {}  # DiffusionGemma's
    # expected embedding of a previous step's logits (each rank its vocabulary rows)
    logits = model.run(ids, positions, model.visible_keys(positions, positions, None), **conditioned)
    out = {"embedding": model.embed(ids), "logits": full_logits(vocabulary_view(logits, model))}
    if model.tp is not None:
        heads = model.tp.heads(model.config.n_heads)
        o = o[:, heads.start:heads.stop]
    for i, layer in enumerate(model.layers):
        if hasattr(layer, "feed_forward"):
            out[f"layer {i} attention output"] = layer.attention_output(o)
            out[f"layer {i} feed-forward"] = layer.feed_forward(x)
    return out


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_sharded_layers_equal_their_dense_twins(preset):
    """Vocabulary-parallel embedding and head, row-parallel attention output, column/row-parallel SwiGLU, expert
    parallel experts with shared experts, and the whole forward (query and key/value heads split or, with fewer
    key/value heads than ranks, replicated)."""
    whole, split = models(preset)
    cfg = whole.config
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    x = torch.randn(2, 12, cfg.hidden_size)
    o = torch.randn(2, cfg.n_heads, 12, cfg.head_dim)
    soft = torch.randn(2, 12, cfg.vocab_size) * 3
    expected, got = layer_outputs(whole, ids, x, o, soft), everywhere(layer_outputs, split, ids, x, o, soft)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-5, msg=name)
    assert split.lm_head.weight.shape[0] == -(-cfg.vocab_size // SIZE)


# -- the samplers' statistics from vocabulary slices ---------------------------------------------------------------
def statistics(logits: torch.Tensor, tokens: torch.Tensor, unscored: torch.Tensor, mask: torch.Tensor,
               seeds: list[int], sharded: bool) -> dict[str, torch.Tensor]:
    """What samplers read of `logits` `[B, C, V]`: from this rank's columns merged over the ranks (`sharded`), or
    from the whole tensor."""
    if sharded:
        shard = Shard.of(parallel.RANKS, logits.shape[-1])
        logits = ShardedLogits(logits[..., shard.start:shard.stop], shard)
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    top = logits.topk(3, -1)
    return {"argmax": logits.argmax(-1), "max": logits.max(-1).values, "top values": top.values,
            "top ids' logits": full_logits(logits).gather(-1, top.indices), "probability": token_probability(logits, tokens),
            "probability, ids unscored": token_probability(logits, tokens, unscored),
            "probability, a mask per row": token_probability(logits, tokens, mask),
            "entropy": token_entropy(logits), "gumbel draw": gumbel_argmax(logits, 0.7, generators),
            "gumbel draw, a temperature per row": gumbel_argmax(logits, torch.tensor([0.0, 2.0]), generators),
            "whole": full_logits(logits)}


@pytest.mark.parametrize("vocab", [127, 128])
def test_merged_statistics_equal_the_whole_logits(vocab):
    """Ties across the ranks' slices go to the smallest id (as `torch.argmax`), a saturated probability stays 1.0,
    -inf columns count nothing in the entropy, the Gumbel noise is the whole vocabulary's; an odd vocabulary leaves
    the last rank one column short (its slice padded to gather)."""
    torch.manual_seed(1)
    logits = torch.randn(2, 6, vocab) * 3
    logits[0, 0, [3, vocab - 2]] = 50.0  # a tie between the ranks' slices, and a saturated softmax
    logits[0, 1, vocab - 1] = 40.0
    logits[1, 2, : vocab // 2] = float("-inf")  # rank 0's columns all -inf
    logits[1, 3, [10, 11]] = logits[1, 3].max() + 1  # a tie inside rank 0's slice
    tokens = torch.randint(0, vocab, (2, 6))
    tokens[0, 0] = 3
    unscored = torch.tensor([3, vocab - 1])
    mask = torch.zeros(2, vocab, dtype=torch.bool)
    mask[1, vocab // 2 + 1] = True
    args = (logits, tokens, unscored, mask, [7, 8])
    expected, got = statistics(*args, sharded=False), everywhere(statistics, *args, True)
    expected["top ids' logits"] = expected["top values"]  # tied ids may come in either order
    assert got["argmax"][0, 0] == 3 and got["argmax"][1, 3] == 10
    assert got["probability"][0, 0] == expected["probability"][0, 0]  # saturated: exactly
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-6, atol=1e-7, msg=name)


# -- tensor parallel 2 commits the tokens of one process ------------------------------------------------------------
def decoded(model, sampler: samplers.Sampler, cache: caches.Cache, prompts=PROMPTS, seeds=(0, 1, 2)):
    """Each prompt a row of one batch (its own seed and sampler): their answers and the forwards, or the refusal."""
    block = model.config.block_size or BLOCK  # a block-causal model's own
    try:
        batch = new_batch(model, sampler, cache, block, block)
        rows = [batch.add(prompt, GEN, seed) for prompt, seed in zip(prompts, seeds)]
        while batch.running:
            batch.run_block()
        return [batch.answer(row) for row in rows], batch.finish().nfe
    except DllmError as error:
        return str(error)


def same_on_two_ranks(preset: str, sampler: str, cache: str, **sampler_args):
    whole, split = models(preset)
    args = {**SHARED.get(sampler, {}), **sampler_args}
    make = functools.partial(samplers.SAMPLERS.create, sampler, **args)
    one, two = (decoded(m, make(), caches.CACHES.create(cache)) for m in (whole, split))
    assert two == one, f"{sampler} x {cache} on {preset}"
    return one


@pytest.mark.parametrize("sampler", [cls.name for cls in samplers.SAMPLERS])
def test_every_sampler_commits_the_tokens_of_one_process(sampler):
    """Greedy and at a temperature where the sampler draws (the same Gumbel draws over the whole vocabulary), with
    no cache and with the dual cache; samplers reading the logits beyond the merged statistics get them gathered."""
    preset = PRESET.get(sampler, "llada-tiny")
    results = [same_on_two_ranks(preset, sampler, cache) for cache in ("none", "dual")]
    if "temperature" in samplers.SAMPLERS.get(sampler).row_params() and sampler != "speculative":
        results.append(same_on_two_ranks(preset, sampler, "none", temperature=0.8))
    assert any(not isinstance(r, str) for r in results)  # not every combination refused


@pytest.mark.parametrize("preset,sampler,args", [("llada-tiny", "threshold", {"threshold": 0.3}),
                                                 ("llada-tiny", "low_confidence", {"temperature": 0.8}),
                                                 ("dream-tiny", "maskgit_plus", {"temperature": 0.5, "top_p": 0.9})])
def test_logprobs_equal_one_process(preset, sampler, args):
    """`logprobs=k`: each token's log-probability and the k best, merged from the ranks' slices (the log-softmax's
    normalizer, the owner's value, the ranks' top k) where the sampler reads them so, else from the gathered logits
    (Dream's truncated distribution)."""
    captured, gathered = [], parallel.RANKS.traffic.calls["gather"]
    for model in models(preset):
        batch = new_batch(model, samplers.SAMPLERS.create(sampler, **args), caches.CACHES.create("none"), BLOCK,
                          BLOCK)
        rows = [batch.add(prompt, GEN, seed, logprobs=3) for seed, prompt in enumerate(PROMPTS)]
        while batch.running:
            batch.run_block()
        captured.append([[(t.token, t.logprob, [i for i, _ in t.top]) for t in batch.logprobs(row)] for row in rows])
    one, two = captured
    assert (parallel.RANKS.traffic.calls["gather"] > gathered) == (sampler == "maskgit_plus")
    assert [[(token, ids) for token, _, ids in row] for row in two] == \
        [[(token, ids) for token, _, ids in row] for row in one]
    assert [value for row in two for _, value, _ in row] == \
        pytest.approx([value for row in one for _, value, _ in row], abs=1e-5)


@pytest.mark.parametrize("cache", [cls.name for cls in caches.CACHES])
@pytest.mark.parametrize("preset", ["llada-tiny", "dream-tiny"])
def test_every_cache_plans_the_same_rows_on_every_rank(cache, preset):
    """Caches that decide from attention (Elastic-Cache, dKV's triggers, d2Cache, dLLM-Cache) reduce their signals
    over the ranks' heads first: tensor parallel 2 recomputes the rows one process does (the same forwards)."""
    args = {"refresh_every": 2} if cache in ("dual", "prefix") else {}
    whole, split = models({"llada-tiny": "sdar-tiny", "dream-tiny": "fast-dllm-v2-tiny"}[preset] if cache == "block"
                          else "wedlm-tiny" if cache == "frontier" else preset)  # block: block-causal models;
    # frontier: causal ones
    sampler = samplers.SAMPLERS.create("random") if cache == "dkv_greedy" else \
        samplers.SAMPLERS.create("threshold", threshold=0.3)  # dKV-Cache-Greedy's commits are known before a step
    one, two = (decoded(m, sampler, caches.CACHES.create(cache, **args)) for m in (whole, split))
    assert two == one and not isinstance(one, str)


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_every_family_commits_the_tokens_of_one_process(preset):
    """Each family's tiny preset (dense, grouped-query, block-causal, MoE with shared experts, DiffusionGemma's
    uniform-state canvas) with its default sampler and cache."""
    from dllm.engine.options import default_cache, model_sampler

    whole, split = models(preset)
    block = whole.config.block_size or BLOCK
    results = []
    for model in (whole, split):
        name, args = model_sampler(model, None, None)
        sampler = samplers.SAMPLERS.create(name, **(args or {}))
        batch = new_batch(model, sampler, caches.CACHES.create(default_cache(model)), block, block)
        rows = [batch.add(prompt, 2 * block, seed) for seed, prompt in enumerate(PROMPTS)]
        while batch.running:
            batch.run_block()
        results.append(([batch.answer(row) for row in rows], batch.finish().nfe))
    assert results[1] == results[0]


@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream", "tiny-sdar", "tiny-dgemma"])
def test_shipped_models_answer_as_one_process(name):
    """`dllm.load(name, tensor_parallel=2)` (each rank reading its slices of the checkpoint) answers as one process."""
    prompt = {"tiny-sdar": "sort: 42,07,19,03", "tiny-dgemma": "copy: k3x9a"}.get(name, "reverse: hello123")
    answers = [dllm.generate(*dllm.load(name, tensor_parallel=n), [prompt, "add: 0457+0068"]).texts for n in (1, 2)]
    assert answers[1] == answers[0]


def test_readme_example_on_two_ranks():
    model, tokenizer = dllm.load("tiny-llada", tensor_parallel=2)
    before = dict(model.tp.ranks.traffic.calls)
    out = dllm.generate(model, tokenizer, "reverse: hello123", sampler="threshold", cache="dual")
    assert out.texts == ["#### 321olleh"]
    calls = {kind: n - before.get(kind, 0) for kind, n in model.tp.ranks.traffic.calls.items()}
    assert calls.get("gather", 0) == 0  # threshold reads merged statistics, never the whole logits: the argmax (its
    assert calls["sampler"] == 2 * out.stats.nfe  # max reused) and the token's logit with the softmax sum


@pytest.mark.filterwarnings("ignore:.*outside the prompts this model was trained on")  # lm-eval's prompts: no template
def test_lm_eval_model_args_take_tensor_parallel():
    """lm-eval's `--model_args tensor_parallel=2` (a string, as lm-eval passes it) answers and scores as one
    process: the ELBO (every rank runs its forwards, the logits gathered) and the greedy check (a decode)."""
    from types import SimpleNamespace

    from dllm.eval.lm_eval_model import DllmLM

    requests = [SimpleNamespace(args=(p, {"until": ["\n"], "max_gen_toks": 32})) for p in ("reverse: abc123",
                                                                                          "add: 0457+0068")]
    one, two = (DllmLM(model="tiny-llada", sampler="threshold", gen_length=32, block_length=32, mc_num=32,
                       tensor_parallel=n) for n in ("1", "2"))
    assert two.generate_until(requests) == one.generate_until(requests)
    scored = [SimpleNamespace(args=("add: 0457+0068\n", "#### 0525")), SimpleNamespace(args=("copy: ab", "#### ba"))]
    a, b = (lm.loglikelihood(scored, disable_tqdm=True) for lm in (one, two))
    assert [greedy for _, greedy in b] == [greedy for _, greedy in a]
    assert [score for score, _ in b] == pytest.approx([score for score, _ in a], rel=1e-5)


@pytest.mark.parametrize("name,args", [("tiny-dream", {}), ("tiny-sdar", {}), ("tiny-llada", {"cfg_scale": 0.5})])
def test_likelihoods_equal_one_process(name, args):
    """Dream's estimator, a block-causal model's block by block, LLaDA's under classifier-free guidance."""
    from dllm.engine.likelihood import elbo

    scores = [elbo(dllm.load(name, tensor_parallel=n)[0], [7, 45, 32, 49, 32], [35, 32, 39], mc_num=16,
                   batch_size=8, **args) for n in (1, 2)]
    assert scores[1] == pytest.approx(scores[0], rel=1e-5)


# -- refusals ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,args,message", [
    ("random:llada-tiny", {"tensor_parallel": 3},
     "llada cannot run on 3 tensor-parallel ranks: its 4 attention heads do not split evenly over 3 ranks"),
    ("random:dream-tiny", {"tensor_parallel": 2, "quantize": "int8"}, "a tensor-parallel model is not quantized"),
    ("random:dream-tiny", {"tensor_parallel": 0}, "tensor_parallel"),
])
def test_models_that_do_not_split_are_refused_in_one_line(name, args, message):
    with pytest.raises(DllmError, match=message) as error:
        dllm.load(name, **args)
    assert "\n" not in str(error.value)


def test_gen_length_auto_is_refused():
    model, tokenizer = dllm.load("tiny-llada", tensor_parallel=2)
    with pytest.raises(DllmError, match="give a fixed gen_length on a tensor-parallel model"):
        dllm.generate(model, tokenizer, "reverse: hello123", gen_length="auto")


# -- every rank decides alike, or the step fails --------------------------------------------------------------------
def loosen(batch: Batch) -> None:
    """A rank's rows commit on another threshold than rank 0's."""
    for row in batch.rows:
        row.sampler = samplers.SAMPLERS.create("threshold", threshold=0.01)


def test_ranks_that_commit_differently_fail_at_that_step():
    whole, split = models("llada-tiny")
    batch = new_batch(split, samplers.SAMPLERS.create("threshold", threshold=0.99), caches.CACHES.create("none"),
                      BLOCK, BLOCK)
    batch.add(PROMPTS[0], GEN)
    parallel.RANKS.post(loosen, batch)
    with pytest.raises(DllmError, match="ranks hold different tokens after block 0 step 0"):
        batch.run_block()


def test_the_ranks_listen_on_loopback_only(group):
    """gloo's sockets between the ranks this process started: nothing reachable from the network."""
    import psutil

    pids = {os.getpid(), *(p.pid for p in group.followers)}
    listening = [c.laddr.ip for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.pid in pids]
    assert len(listening) >= 2 * SIZE and set(listening) <= {"127.0.0.1", "::1", "::ffff:127.0.0.1"}, listening


def test_a_callback_that_cancels_or_raises_mid_block_reaches_every_rank():
    """`dllm serve`'s pattern: the callback after a step cancels a row (rank 0's call reaches the others with the
    step's check), and a callback that raises stops every rank's block, the ranks still in step after."""
    answers = []
    for model in models("llada-tiny"):
        def cancel(info):
            if (info["block"], info["step"]) == (0, 2):
                batch.cancel(rows[1])

        batch = new_batch(model, samplers.SAMPLERS.create("low_confidence"), caches.CACHES.create("none"), BLOCK,
                          BLOCK, LoopOptions(callback=cancel))
        rows = [batch.add(prompt, GEN, seed) for seed, prompt in enumerate(PROMPTS)]
        sent = parallel.RANKS.traffic.calls["control"]
        while batch.running:
            batch.run_block()
        answers.append(([batch.answer(row) for row in rows], batch.finish().nfe))
    assert answers[1] == answers[0]
    # rank 0's calls went out at the block starts and the cancel's step only, not after every step's callback
    assert parallel.RANKS.traffic.calls["control"] - sent <= GEN // BLOCK + 2 < answers[0][1]
    assert PRESETS["llada-tiny"].mask_id in answers[0][0][1]  # the cancelled row stopped with masks left

    def refuse(info):
        if info["step"] == 1:
            raise DllmError("stop here")

    whole, split = models("llada-tiny")
    batch = new_batch(split, samplers.SAMPLERS.create("low_confidence"), caches.CACHES.create("none"), BLOCK, BLOCK,
                      LoopOptions(callback=refuse))
    batch.add(PROMPTS[0], GEN)
    with pytest.raises(DllmError, match="stop here"):
        batch.run_block()
    assert decoded(split, samplers.SAMPLERS.create("threshold"), caches.CACHES.create("dual")) == \
        decoded(whole, samplers.SAMPLERS.create("threshold"), caches.CACHES.create("dual"))


# -- a killed rank ----------------------------------------------------------------------------------------------------
STOPPED = """
import os, signal, sys, time, torch, dllm
from dllm.models import parallel
model, tokenizer = dllm.load("tiny-llada", tensor_parallel=2)
print(parallel.RANKS.directory, file=sys.stderr)
os.kill(parallel.RANKS.followers[0].pid, getattr(signal, sys.argv[1]))
started = time.monotonic()
try:
    dllm.generate(model, tokenizer, "reverse: hello123")
except dllm.DllmError as error:
    print(f"{time.monotonic() - started:.1f} s: {error}")
"""


@pytest.mark.parametrize("signal_name,message", [
    ("SIGKILL", "tensor-parallel rank 1 exited (code -9)"),
    ("SIGSTOP", "a tensor-parallel rank did not answer within 5 s (DLLM_TP_TIMEOUT)")])
def test_a_killed_or_hung_rank_ends_the_run_with_one_line(signal_name, message):
    """A dead rank is seen at the next collective; a hung one after DLLM_TP_TIMEOUT (rank 0's calls to the others
    included); rank 0 exits without waiting for it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DLLM_TP_TIMEOUT": "5"}
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", STOPPED, signal_name], capture_output=True, text=True, timeout=120,
                         env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    seconds, _, said = out.stdout.strip().partition(" s: ")
    assert said == f"{message}; the model's ranks cannot go on, load it again", out
    assert float(seconds) < 10 and time.monotonic() - started < 60
    assert not os.path.exists(out.stderr.splitlines()[0])  # the directory the ranks met at, removed
