"""PC-Sampler (`samplers/pc_sampler.py`) against a plain transcription of the authors' `generate_with_pc_sampler`
at temperature 0: the same tokens in the same number of forwards on tiny-llada (and the same rule on tiny-dream's
aligned logits), with clip ties and float32 underflow ties; the token-frequency tables, their formats and errors."""
import json
import shutil
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, random_model

import dllm
from dllm import cache as caches
from dllm import samplers
from dllm.core.errors import DllmError
from dllm.engine import decode
from dllm.engine.text import encode_prompts
from dllm.models.loading import SHIPPED_DIR

sys.path.insert(0, str(ROOT / "scripts"))
import count_token_frequency  # noqa: E402

PROMPTS = ["reverse: abc12", "sort: 42,07,19,03", "add: 0457+0168", "copy: k3x9a"]


def baseline(path, vocab):
    """`load_baseline`: count / num_token per listed token, 1 / num_token for the others, float32."""
    data = json.loads(path.read_text())
    total = data["total"]
    table = torch.full((vocab,), 1 / total, dtype=torch.float32)
    ids = torch.tensor([int(i) for i in data["counts"]])
    table.scatter_(0, ids, torch.tensor([n / total for n in data["counts"].values()], dtype=torch.float32))
    return table


def reference(model, prompt, gen_length, block_length, steps, lambd, alpha, table):
    """`generate_with_pc_sampler` (low_confidence, no cfg) at temperature 0 for one prompt, step by step: every step
    of every block a full forward; c = softmax in the logits' dtype at the argmax; for the block's index k,
    exp(-lambd k) * clamp(-c ln(f + 1e-9), max=alpha) in float32, -inf where decoded; `topk` of the schedule's n_t.
    The one change: MASK's logit is -inf. Returns the answer, the forwards and the steps whose chosen score was
    tied with a position left masked (where `topk`'s order decided)."""
    mask = model.config.mask_id
    x = torch.tensor([prompt + [mask] * gen_length])
    per_block = steps // (gen_length // block_length)
    forwards = ties = 0
    for block in range(gen_length // block_length):
        start, end = len(prompt) + block * block_length, len(prompt) + (block + 1) * block_length
        masks = int((x[0, start:end] == mask).sum())
        schedule = [masks // per_block + (i < masks % per_block) for i in range(per_block)]
        for i in range(per_block):
            mask_index = x == mask
            logits = model(x)
            forwards += 1
            logits[..., mask] = float("-inf")
            x0 = logits.argmax(-1)
            x0_p = F.softmax(logits, dim=-1).gather(-1, x0[..., None])[..., 0]
            x0 = torch.where(mask_index, x0, x)
            scores = torch.clamp(-x0_p[:, start:end] * torch.log(table[x0[:, start:end]] + 1e-9), max=alpha)
            scores = torch.exp(-lambd * torch.arange(block_length, dtype=torch.float32)) * scores
            confidence = torch.where(mask_index[:, start:end], scores, float("-inf"))
            chosen = torch.topk(confidence[0], k=schedule[i]).indices
            left = torch.ones(block_length, dtype=torch.bool)
            left[chosen] = False
            ties += bool(torch.isin(confidence[0, left], confidence[0, chosen]).any())
            x[0, chosen + start] = x0[0, chosen + start]
    return x[0, len(prompt):].tolist(), forwards, ties


def ours(model, tok, prompts, gen_length, block_length, steps, **args):
    out = dllm.generate(model, tok, prompts, sampler="pc_sampler", gen_length=gen_length, block_length=block_length,
                        steps=steps, chat=True, stop_early=False, **args)
    return out.sequences[:, out.sequences.shape[1] - gen_length:].tolist(), out.stats.nfe


CONFIGS = {  # the spec's fidelity configurations (a)-(c)
    "a": dict(gen_length=16, block_length=16, steps=16, lambd=0.25, alpha=10.0),
    "b": dict(gen_length=16, block_length=8, steps=16, lambd=0.0, alpha=0.5),  # clipped scores tie
    "c": dict(gen_length=128, block_length=128, steps=128, lambd=1.0, alpha=10.0),  # exp(-k) is 0 from k = 104
}


@pytest.mark.parametrize("config,name", [(c, n) for c in CONFIGS for n in ("tiny-llada", "tiny-dream")
                                         if (c, n) != ("c", "tiny-dream")])  # (c): 128 forwards, LLaDA's only
def test_pc_sampler_is_the_authors_generate_with_pc_sampler(tiny_llada, tiny_dream, name, config):
    """On tiny-llada the authors' LLaDA code; on tiny-dream the same rule on its aligned logits (their code is
    LLaDA's)."""
    model, tok = tiny_llada if name == "tiny-llada" else tiny_dream
    c = CONFIGS[config]
    table = baseline(SHIPPED_DIR / name / "token_frequency.json", model.config.vocab_size)
    prompts = PROMPTS if config != "c" else PROMPTS[2:3]
    tied = 0
    for ids, prompt in zip(encode_prompts(tok, prompts, chat=True), prompts):
        want, forwards, ties = reference(model, ids, **c, table=table)
        got, nfe = ours(model, tok, [prompt], c["gen_length"], c["block_length"], c["steps"],
                        position_decay=c["lambd"], clip=c["alpha"])
        assert (got[0], nfe) == (want, forwards), prompt
        tied += ties
    assert (tied > 0) == (config != "a")  # ties decided in (b) and (c)


def test_a_padded_batch_is_each_prompt_alone(tiny_llada):
    model, tok = tiny_llada
    args = dict(gen_length=32, block_length=8, steps=16, position_decay=0.5, clip=1.0)
    batch, _ = ours(model, tok, PROMPTS, **args)
    assert batch == [ours(model, tok, [p], **args)[0][0] for p in PROMPTS]


def test_the_shipped_tables_count_the_training_split(tiny_llada, tiny_dream):
    """Both counted from the same texts (`make_split("train", 40000)`: 200,000 examples, each answer with one
    '####'), each with its own tokenizer's ids."""
    by_text = []
    for model, tok in (tiny_llada, tiny_dream):
        table = json.loads((SHIPPED_DIR / tok.name_or_path.split("/")[-1] / "token_frequency.json").read_text())
        assert table["total"] == sum(table["counts"].values())
        by_text.append({tok.convert_ids_to_tokens(int(i)): n for i, n in table["counts"].items()})
    assert by_text[0] == by_text[1] and by_text[0]["#"] == 4 * 200_000


def test_a_checkpoint_reads_its_table_and_the_script_writes_it(tmp_path, tiny_llada):
    """The table beside a checkpoint (counted by scripts/count_token_frequency.py from a JSONL corpus) is the one
    the sampler reads; missing, it is a one-line error naming the file and the command, before any work."""
    model_dir = tmp_path / "tiny"
    shutil.copytree(SHIPPED_DIR / "tiny-llada", model_dir, ignore=shutil.ignore_patterns("token_frequency.json"))
    model, tok = dllm.load(str(model_dir))
    with pytest.raises(DllmError, match=rf"^sampler 'pc_sampler' needs the token-frequency table {model_dir}/"
                                        rf"token_frequency.json; count it with python scripts/count_token_frequency"
                                        rf".py {model_dir} --corpus FILE.jsonl"):
        ours(model, tok, PROMPTS, 16, 16, 16)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "#### 21cba", "id": 3}\n{"text": "copy: zz", "other": "#"}\n')
    count_token_frequency.main([str(model_dir), "--corpus", str(corpus)])
    table = json.loads((model_dir / "token_frequency.json").read_text())
    assert table["total"] == 18 and table["counts"][str(tok.convert_tokens_to_ids("#"))] == 4
    args = dict(gen_length=16, block_length=16, steps=16)
    assert ours(model, tok, PROMPTS, **args) == ours(model, tok, PROMPTS, **args, frequency_file=str(
        model_dir / "token_frequency.json")) != ours(*tiny_llada, PROMPTS, **args)  # its own table decides


def test_the_authors_table_format_is_read(tmp_path, tiny_llada):
    ours_file = SHIPPED_DIR / "tiny-llada" / "token_frequency.json"
    table = json.loads(ours_file.read_text())
    theirs = tmp_path / "reference_corpus_tiny.json"
    theirs.write_text(json.dumps({"num_token": table["total"], "p_baseline_dict": table["counts"]}))
    args = dict(gen_length=16, block_length=8, steps=16)
    assert ours(*tiny_llada, PROMPTS, **args, frequency_file=str(theirs)) == ours(*tiny_llada, PROMPTS, **args)


def test_bad_tables_are_refused(tmp_path, tiny_llada):
    model, tok = tiny_llada
    bad = tmp_path / "bad.json"
    for content, error in [({"total": 10}, "is no token-frequency table"),
                           ({"total": 10, "counts": {"a": 3}}, "lists a token that is no integer id"),
                           ({"total": 10, "counts": {"3": -1}}, "negative or non-integer"),
                           ([1, 2], "holds a JSON list, not an object")]:
        bad.write_text(json.dumps(content))
        with pytest.raises(DllmError, match=error):
            samplers.SAMPLERS.create("pc_sampler", frequency_file=str(bad))
    with pytest.raises(DllmError, match="frequency_file /nowhere.json does not exist; count one with"):
        samplers.SAMPLERS.create("pc_sampler", frequency_file="/nowhere.json")
    bad.write_text(json.dumps({"total": 10, "counts": {"60": 3}}))
    with pytest.raises(DllmError, match=r"lists token id 60, outside this model's vocabulary \(54 tokens\)"):
        ours(model, tok, PROMPTS, 16, 16, 16, frequency_file=str(bad))


def test_a_model_without_a_directory_needs_frequency_file():
    model, tok = dllm.load("random:llada-tiny")
    with pytest.raises(DllmError, match="this model has none .a random: model.; set frequency_file"):
        ours(model, tok, PROMPTS, 16, 16, 16)
    with pytest.raises(DllmError, match="has no token-frequency table: decode through dllm.generate"):
        decode(random_model("llada-tiny"), [[5, 6, 7]], samplers.SAMPLERS.create("pc_sampler"),
               caches.CACHES.create("none"), 16, 16)
