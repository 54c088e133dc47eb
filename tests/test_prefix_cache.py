"""The prefix cache across requests (`cache.PrefixBlocks`) on block-causal models: reused keys and values equal
computed ones wherever padding puts a row, answers equal decoding without it (rows of one batch with different
prefixes, rows joining between blocks, a small LRU bound), fewer rows computed, hits in /metrics, and a one-line
refusal for full-attention models."""
import subprocess
import sys
import urllib.request

import pytest
from conftest import random_model

import dllm
from dllm import cache as caches
from dllm import samplers
from dllm.core.errors import DllmError
from dllm.engine import Batch
from dllm.engine.decoding import decoded
from dllm.engine.options import LoopOptions

SHARED = list(range(5, 5 + 13))  # a "system prompt": 3 whole blocks of 4 and one token
PROMPTS = [SHARED + [40, 41, 42], SHARED[:9] + [43, 44, 45, 46, 47, 48, 49], [50, 51, 52], SHARED + [53] * 9]
# whole blocks before the answer: 4, 4 (2 of them SHARED's), 0, 5 (3 SHARED's, as prompt 0)


def run(model, prompts, prefix=None, sampler="low_confidence_dynamic", gen=16, **args):
    return decoded(model, prompts, samplers.SAMPLERS.create(sampler, **args), caches.CACHES.create("block"), gen,
                   model.config.block_size, seed=1, prefix_cache=prefix)


@pytest.mark.parametrize("preset", ["sdar-tiny", "fast-dllm-v2-tiny", "llada2-tiny"])
def test_answers_with_kept_blocks_equal_answers_without(preset):
    """The same prompts decoded again (reused blocks at other columns: a batch's padding moves them) and prompts
    that share only some blocks with earlier ones: the answers of decoding without a prefix cache, fewer rows
    computed, and hits counted in whole blocks."""
    model = random_model(preset, seed=1)
    prefix = caches.PrefixBlocks(model, 8)
    want = [run(model, PROMPTS[:2]), run(model, PROMPTS[1:])]
    first = run(model, PROMPTS[:2], prefix)
    assert prefix.hits == 0 and prefix.queried == 16 + 16  # whole blocks before the answer: 4 per prompt
    second = run(model, PROMPTS[1:], prefix)  # row 0 as before; row 2 shares 3 blocks with the first run's row 0
    assert prefix.hits == 16 + 12 and prefix.queried == 32 + 16 + 0 + 20
    for got, wanted in zip((first, second), want):
        assert [got.answer(row) for row in got.rows] == [wanted.answer(row) for row in wanted.rows]
    assert second.rows_computed < want[1].rows_computed


def test_kept_keys_and_values_equal_computed_ones():
    """After a layout's first forward, every column before the block holds the same keys and values whether they
    were computed there or loaded from blocks kept by a batch that padded the rows differently."""
    model = random_model("sdar-tiny", seed=1)
    prefix = caches.PrefixBlocks(model, 8)
    run(model, [PROMPTS[3], PROMPTS[2]], prefix)
    sampler, cache = samplers.SAMPLERS.create("low_confidence_dynamic"), caches.CACHES.create("block")
    stores = []
    for kept in (None, prefix):
        batch = Batch(model, sampler, cache, 4, 4, LoopOptions(prefix_cache=kept))
        for prompt in PROMPTS[:2]:
            batch.add(prompt, 8)
        batch.run_block()
        stores.append(batch.runner.kv)
    computed, loaded = stores
    assert loaded.final == computed.final and prefix.hits == 12 + 8
    for mine, theirs in zip(computed.k + computed.v, loaded.k + loaded.v):
        assert (mine[:, :, :computed.final] - theirs[:, :, :computed.final]).abs().max() < 1e-5


def test_rows_joining_between_blocks_reuse_their_blocks_and_answer_as_alone():
    """Between blocks the batch is laid out anew with a fresh store: every row's finished blocks and the joining
    row's shared prompt come from the prefix cache, and each row answers as it does alone without one."""
    model = random_model("sdar-tiny", seed=1)
    sampler, cache = samplers.SAMPLERS.create("threshold", threshold=0.3), caches.CACHES.create("block")
    prefix = caches.PrefixBlocks(model, 8)
    batch = Batch(model, sampler, cache, 4, 4, LoopOptions(prefix_cache=prefix))
    rows = [batch.add(PROMPTS[0], 12)]
    batch.run_block()
    batch.run_block()
    rows.append(batch.add(PROMPTS[3], 8))
    hits = prefix.hits
    batch.run_block()
    assert prefix.hits - hits == 16 + 4 + 12  # row 0: its prompt's blocks and a finished one; row 1: SHARED's
    while batch.running:
        batch.run_block()
    for row, prompt, gen in zip(rows, (PROMPTS[0], PROMPTS[3]), (12, 8)):
        alone = run(model, [prompt], sampler="threshold", gen=gen, threshold=0.3)
        assert batch.answer(row) == alone.answer(alone.rows[0])


def test_a_small_cache_evicts_least_recently_used_blocks_from_a_chains_end():
    model = random_model("sdar-tiny", seed=1)
    block_bytes = 2 * 2 * 2 * 4 * 32 * 4  # k and v, 2 layers, 2 kv heads, 4 tokens, head dim 32, fp32
    prefix = caches.PrefixBlocks(model, 3 * block_bytes / 2**20)
    run(model, [PROMPTS[3]], prefix)
    want = run(model, [PROMPTS[3]])
    got = run(model, [PROMPTS[3]], prefix)
    assert prefix.nbytes <= 3 * block_bytes and prefix.evicted > 0 and prefix.hits == 12
    assert got.answer(got.rows[0]) == want.answer(want.rows[0])
    assert list(prefix.blocks) == prefix.keys(PROMPTS[3][:12])[::-1]  # the first blocks kept, the first the newest


def test_refusals():
    llada = dllm.load("tiny-llada")[0]
    with pytest.raises(DllmError, match="a prefix cache needs a block-causal or causal-prefix model .* under llada's "
                                        "full attention a prompt's keys and values depend on the answer; drop "
                                        "--prefix-cache-mb"):
        caches.PrefixBlocks(llada, 8)
    sdar = random_model("sdar-tiny")
    with pytest.raises(DllmError, match="cache 'none' recomputes them: use cache block or no prefix cache"):
        Batch(sdar, samplers.SAMPLERS.create("threshold"), caches.CACHES.create("none"), 4, 4,
              LoopOptions(prefix_cache=caches.PrefixBlocks(sdar, 8)))
    with pytest.raises(DllmError, match="holds another model's keys and values"):
        Batch(sdar, samplers.SAMPLERS.create("threshold"), caches.CACHES.create("block"), 4, 4,
              LoopOptions(prefix_cache=caches.PrefixBlocks(random_model("sdar-tiny"), 8)))
    with pytest.raises(DllmError, match="the prefix cache size must be a positive number of MiB, got -1"):
        caches.PrefixBlocks(sdar, -1)


@pytest.mark.parametrize("args,message", [
    (["--model", "tiny-llada", "--prefix-cache-mb", "8"], "a prefix cache needs a block-causal or causal-prefix model"),
    (["--model", "tiny-sdar", "--cache", "none", "--prefix-cache-mb", "8"],
     "--prefix-cache-mb reuses the keys and values cache 'block' keeps; the default cache 'none' recomputes them"),
])
def test_serve_refuses_a_prefix_cache_it_cannot_use(args, message):
    pytest.importorskip("fastapi")
    proc = subprocess.run([sys.executable, "-m", "dllm.cli", "serve", "--port", "0", *args], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert message in proc.stderr


def test_served_requests_share_a_system_prompt_and_report_hits():
    """Chat requests after one system message, several clients at once: each answer is its solo answer, and
    /metrics counts the reused tokens and the rows computed."""
    pytest.importorskip("fastapi")
    from dllm.serve import EngineClient, EngineSpec, LocalServer, load
    from dllm.serve.bench import system_prompt

    model, tok = dllm.load("tiny-sdar")
    defaults = {"sampler": "low_confidence_dynamic", "cache": "block", "sampler_args": {}, "cache_args": {},
                "gen_length": 32, "block_length": None, "steps": None, "seed": 0}
    system = {"role": "system", "content": system_prompt(tok, 64)}
    tasks = ["copy: k3x9a", "reverse: abc12", "sort: 3,1,2", "copy: zzyx", "add: 0012+0034", "reverse: q1w2"]
    bodies = [{"messages": [system, {"role": "user", "content": t}]} for t in tasks]
    engine = EngineClient.spawn(EngineSpec("tiny-sdar", max_batch=4, prefix_cache_mb=4), defaults)
    solo = [dllm.generate(model, tok, [engine.job(b, chat=True).ids], sampler="low_confidence_dynamic",
                          gen_length=32).texts[0] for b in bodies]
    with LocalServer(engine) as local:
        run = load(local.url + "/v1/chat/completions", bodies, concurrency=3)
        with urllib.request.urlopen(local.url + "/metrics") as r:
            text = r.read().decode()
    assert [a["choices"][0]["message"]["content"] for _, a, _ in run["results"]] == solo
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line[:1] != "#"}
    assert values["dllm_prefix_cache_hit_tokens_total"] >= 3 * 64 // 4 * 4  # later requests reuse the system prompt
    assert values["dllm_prefix_cache_queried_tokens_total"] > values["dllm_prefix_cache_hit_tokens_total"]
    assert values["dllm_prefix_cache_bytes"] > 0 and values["dllm_rows_computed_total"] > 0


def test_bench_serve_counts_fewer_rows_with_a_prefix_cache():
    """`dllm bench-serve --system-prompt-tokens 64`: every served answer equals its sequential one with the prefix
    cache and without, and the cache computes fewer rows."""
    pytest.importorskip("fastapi")
    from dllm.engine.text import encode_text
    from dllm.serve import EngineSpec
    from dllm.serve.bench import bench_serve, system_prompt

    model, tok = dllm.load("tiny-sdar")
    assert len(encode_text(tok, system_prompt(tok, 64), "")) == 64
    defaults = {"sampler": "low_confidence_dynamic", "cache": "block", "sampler_args": {}, "cache_args": {},
                "gen_length": 32, "block_length": None, "steps": None, "seed": 0}
    rows = []
    for mib in (0, 4):
        result = bench_serve(model, tok, EngineSpec("tiny-sdar", max_batch=4, prefix_cache_mb=mib), defaults,
                             requests=6, concurrency=(3,), system_prompt_tokens=64)
        (served,) = result["rows"][1:]
        assert served["errors"] == served["mismatches"] == 0
        rows.append(served["rows"])
    assert rows[1] < rows[0]


@pytest.mark.parametrize("preset,sampler,args,block,steps", [
    ("nemotron-diffusion-tiny", "threshold", {"threshold": 0.5}, 8, None),
    ("diffusion-gemma-tiny", "entropy_bound", {}, 16, 6)])
def test_causal_prefix_models_reuse_chunks_of_any_prompt(preset, sampler, args, block, steps):
    """Nemotron-Labs-Diffusion and DiffusionGemma encode the prompt and finished blocks causally, so any run of
    tokens is exact to reuse: chunks of 16, wherever the prompt ends (DiffusionGemma's layers hold keys of two
    shapes). DiffusionGemma's steps are few: over near-equal entropies (random weights) its entropy bound orders
    positions by differences of float rounding, as a padded row's do."""
    model = random_model(preset, seed=1)
    shared = list(range(5, 45))  # 40 tokens: 2 whole chunks
    first, second = [shared + [50, 51], shared[:20] + [52, 53, 54]], [shared + [55], shared[:33]]

    def run(prompts, prefix=None):
        return decoded(model, prompts, samplers.SAMPLERS.create(sampler, **args), caches.CACHES.create("block"),
                       2 * block, block, steps, prefix_cache=prefix)

    prefix = caches.PrefixBlocks(model, 8)
    for prompts in (first, second):
        got, want = run(prompts, prefix), run(prompts)
        assert [got.answer(row) for row in got.rows] == [want.answer(row) for row in want.rows]
    assert prefix.hits == 32 + 32 and got.rows_computed < want.rows_computed
