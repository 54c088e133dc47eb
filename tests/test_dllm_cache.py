"""dLLM-Cache (issue #46 item 3): the `dllm_cache` cache against a plain transcription of maomaocun/dLLM-cache
(`dllm_cache/hooks/cache_hook_LLaDA.py` `cache_hook_feature` and `refresh_index`, `dllm_cache/cache/Cache.py`'s
refresh rule, `utils/generate_function.py` `generate`), token for token, forward for forward and row for row on the
shipped tiny models (the spec's fidelity configurations, strategies_2026.md); Kp = Kr = 1 is no cache; batching."""
import pytest
import torch
import torch.nn.functional as F

import dllm
from dllm import cache as caches
from dllm import samplers
from dllm.engine import decode
from dllm.engine.text import encode_prompts
from dllm.models.transformer import head, rope

PROMPTS = ["reverse: abc12", "sort: 42,07,19,03", "add: 0457+0168", "copy: k3x9a"]


@pytest.fixture(scope="module", params=["tiny-llada", "tiny-dream"])
def tiny(request):
    return dllm.load(request.param)


# ---- the transcription (batch 1, step by step) -------------------------------------------------------------------

class ReferenceFeatureCache:
    """`dLLMCache` for one row: per (prompt | gen, layer) the keys and values before RoPE, the attention output and
    the MLP output; the refresh rule of forward n (from 1): prompt iff (n - 1) % Kp == 0, gen iff (n - 1) % Kr == 0."""

    def __init__(self, prompt_interval, gen_interval, transfer_ratio, prompt_length):
        self.kp, self.kr, self.ratio, self.prompt_length = prompt_interval, gen_interval, transfer_ratio, prompt_length
        self.store, self.step = {}, 0


def reference_layer(model, block, layer, x, cache, through):
    """`cache_hook_feature` on one layer of our model for the input `x` `[1, T, d]`; appends to `through` the rows
    whose attention and MLP it computes."""
    P, store = cache.prompt_length, cache.store
    T = x.shape[1]
    refresh_gen = (cache.step - 1) % cache.kr == 0 or layer == 0
    refresh_prompt = (cache.step - 1) % cache.kp == 0 or layer == 0
    transfer = 0 < cache.ratio <= 1
    n_heads, n_kv, hd = block.n_heads, block.n_kv_heads, block.head_dim
    w, b = block.qkv_proj.weight, block.qkv_proj.bias
    sizes = (n_heads * hd, n_kv * hd, n_kv * hd)

    def linear(h, part):
        lo = sum(sizes[:part])
        return F.linear(h, w[lo:lo + sizes[part]], None if b is None else b[lo:lo + sizes[part]])

    def project(h_in):
        h = block.attn_norm(h_in)
        return linear(h, 0), linear(h, 1), linear(h, 2)

    def attention(q, k, v, q_index=None):  # queries at q_index (default: the last rows), keys at 0..T-1, no mask
        q_index = torch.arange(T - q.shape[1], T)[None] if q_index is None else q_index
        q = q.view(1, -1, n_heads, hd).transpose(1, 2)
        k = k.view(1, -1, n_kv, hd).transpose(1, 2)
        v = v.view(1, -1, n_kv, hd).transpose(1, 2)
        q = rope(q, *model.rope_tables(q_index))
        k = rope(k, *model.rope_tables(torch.arange(T)[None]))
        k, v = k.repeat_interleave(n_heads // n_kv, 1), v.repeat_interleave(n_heads // n_kv, 1)
        att = F.scaled_dot_product_attention(q, k, v)
        return block.o_proj(att.transpose(1, 2).contiguous().view(1, -1, n_heads * hd))

    def refresh_index(v_new, v_cached):
        num = int(v_new.shape[1] * cache.ratio)
        return torch.topk(F.cosine_similarity(v_new, v_cached, dim=-1), largest=False, k=num).indices

    def verify(x_gen):  # V for every gen row; Q, K for the least similar; all V and those K replace the cached
        x_gen_normed = block.attn_norm(x_gen)
        v_gen = linear(x_gen_normed, 2)
        index = refresh_index(v_gen, store["gen", layer, "v"])
        selected = torch.gather(x_gen_normed, 1, index[..., None].expand(-1, -1, x_gen.shape[-1]))
        store["gen", layer, "v"] = v_gen
        store["gen", layer, "k"] = store["gen", layer, "k"].scatter(
            1, index[..., None].expand(-1, -1, sizes[1]), linear(selected, 1))
        return index, linear(selected, 0)

    x_prompt, x_gen = x[:, :P], x[:, P:]
    if refresh_gen and refresh_prompt:
        q, k, v = project(x)
        store["prompt", layer, "k"], store["prompt", layer, "v"] = k[:, :P], v[:, :P]
        store["gen", layer, "k"], store["gen", layer, "v"] = k[:, P:], v[:, P:]
        att = attention(q, k, v)
        store["prompt", layer, "attn"], store["gen", layer, "attn"] = att[:, :P], att[:, P:]
        through.append(T)
    elif refresh_gen:
        q, k_gen, v_gen = project(x_gen)
        store["gen", layer, "k"], store["gen", layer, "v"] = k_gen, v_gen
        k = torch.cat([store["prompt", layer, "k"], k_gen], 1)
        v = torch.cat([store["prompt", layer, "v"], v_gen], 1)
        store["gen", layer, "attn"] = attention(q, k, v)
        att = torch.cat([store["prompt", layer, "attn"], store["gen", layer, "attn"]], 1)
        through.append(T - P)
    elif refresh_prompt:
        q_prompt, k_prompt, v_prompt = project(x_prompt)
        store["prompt", layer, "k"], store["prompt", layer, "v"] = k_prompt, v_prompt
        if transfer:
            index, q_gen = verify(x_gen)
        k = torch.cat([k_prompt, store["gen", layer, "k"]], 1)
        v = torch.cat([v_prompt, store["gen", layer, "v"]], 1)
        if transfer:
            both = attention(torch.cat([q_prompt, q_gen], 1), k, v,
                             torch.cat([torch.arange(P)[None], index + P], 1))
            store["prompt", layer, "attn"] = both[:, :P]
            store["gen", layer, "attn"] = store["gen", layer, "attn"].scatter(
                1, index[..., None].expand(-1, -1, x.shape[-1]), both[:, P:])
        else:
            store["prompt", layer, "attn"] = attention(q_prompt, k, v, torch.arange(P)[None])
        att = torch.cat([store["prompt", layer, "attn"], store["gen", layer, "attn"]], 1)
        through.append(P + (index.shape[1] if transfer else 0))
    else:
        if transfer:
            index, q_gen = verify(x_gen)
            k = torch.cat([store["prompt", layer, "k"], store["gen", layer, "k"]], 1)
            v = torch.cat([store["prompt", layer, "v"], store["gen", layer, "v"]], 1)
            store["gen", layer, "attn"] = store["gen", layer, "attn"].scatter(
                1, index[..., None].expand(-1, -1, x.shape[-1]), attention(q_gen, k, v, index + P))
        att = torch.cat([store["prompt", layer, "attn"], store["gen", layer, "attn"]], 1)
        through.append(index.shape[1] if transfer else 0)

    x = x + att
    og_x, x_prompt, x_gen = x, x[:, :P], x[:, P:]
    if refresh_gen and refresh_prompt:
        x = block.feed_forward(x)
        store["gen", layer, "mlp"], store["prompt", layer, "mlp"] = x[:, P:], x[:, :P]
    elif refresh_gen:
        store["gen", layer, "mlp"] = block.feed_forward(x_gen)
        x = torch.cat([store["prompt", layer, "mlp"], store["gen", layer, "mlp"]], 1)
    elif refresh_prompt:
        if transfer:
            both = block.feed_forward(torch.cat([x_prompt, torch.gather(
                x_gen, 1, index[..., None].expand(-1, -1, x.shape[-1]))], 1))
            x_prompt = both[:, :P]
            store["gen", layer, "mlp"] = store["gen", layer, "mlp"].scatter(
                1, index[..., None].expand(-1, -1, x.shape[-1]), both[:, P:])
        else:
            x_prompt = block.feed_forward(x_prompt)
        store["prompt", layer, "mlp"] = x_prompt
        x = torch.cat([x_prompt, store["gen", layer, "mlp"]], 1)
    else:
        if transfer:
            selected = torch.gather(x_gen, 1, index[..., None].expand(-1, -1, x.shape[-1]))
            store["gen", layer, "mlp"] = store["gen", layer, "mlp"].scatter(
                1, index[..., None].expand(-1, -1, x.shape[-1]), block.feed_forward(selected))
        x = torch.cat([store["prompt", layer, "mlp"], store["gen", layer, "mlp"]], 1)
    return og_x + x


def reference_logits(model, x, cache, through):
    """The model over canvas `x` `[T]` with every layer hooked; position-aligned logits `[T, V]` (Dream: row i - 1
    predicts i)."""
    cache.step += 1
    h = model.embed(x)[None]
    for layer, block in enumerate(model.layers):
        h = reference_layer(model, block, layer, h, cache, through)
    logits = head(model.norm(h), model.lm_head.weight)[0]
    return torch.cat([logits[:1], logits[:-1]]) if model.config.logit_shift else logits


@torch.no_grad()
def reference_generate(model, prompt, gen_length, block_length, steps, prompt_interval, gen_interval, ratio):
    """`generate` of utils/generate_function.py at temperature 0, low-confidence remasking, no CFG, with the cache
    reset for the prompt. Returns the answer, the forwards and the rows computed per layer at each forward. The one
    change: MASK's logit is -inf (the toolkit never proposes MASK)."""
    mask_id, P = model.config.mask_id, len(prompt)
    x = torch.tensor(prompt + [mask_id] * gen_length)
    cache = ReferenceFeatureCache(prompt_interval, gen_interval, ratio, P)
    per_block = steps // (gen_length // block_length)
    rows = []
    for block in range(gen_length // block_length):
        start = P + block * block_length
        n = int((x[start:start + block_length] == mask_id).sum())
        schedule = [n // per_block + (i < n % per_block) for i in range(per_block)]
        for i in range(per_block):
            mask_index = x == mask_id
            through = []
            logits = reference_logits(model, x, cache, through)[P:]
            rows.append(through)
            logits[:, mask_id] = -torch.inf
            x0 = logits.argmax(-1)
            x0_p = torch.softmax(logits, -1).gather(-1, x0[:, None])[:, 0]
            x0_p[(block + 1) * block_length:] = -torch.inf
            confidence = torch.where(mask_index[P:], x0_p, -torch.inf)
            chosen = torch.topk(confidence, k=schedule[i]).indices
            x[P + chosen] = x0[chosen]
    return x[P:].tolist(), len(rows), rows


def ours(model, prompts, gen_length, block_length, steps, cache="dllm_cache", **cache_args):
    """Our low-confidence decode of token-id `prompts`: the answers, the forwards, the rows per layer of each."""
    canvas, stats, trace = decode(model, prompts, samplers.SAMPLERS.create("low_confidence"),
                                  caches.CACHES.create(cache, **cache_args), gen_length, block_length, steps,
                                  stop_early=False, trace=True)
    return (canvas.tokens[:, canvas.prompt_length:].tolist(), stats,
            [[n // len(prompts) for n in step["rows_per_layer"]] for step in trace])


# ---- tests ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("gen,block,steps,kp,kr,ratio", [
    (32, 8, 32, 1, 1, 0.25),  # (a): every forward refreshes everything
    (32, 8, 32, 4, 2, 0.0),  # (b): intervals, no V-verify
    (16, 8, 16, 4, 3, 0.25),  # (c): V-verify recomputes int(16 x 0.25) = 4 answer rows per layer
    (32, 8, 32, 4, 3, 1.0),  # (d): V-verify recomputes every answer row
    (32, 32, 16, 3, 2, 0.25),  # two tokens per step, one block, prompt-only refreshes with V-verify
])
def test_dllm_cache_equals_the_transcription(tiny, gen, block, steps, kp, kr, ratio):
    """Same tokens, same forwards, the same rows through every layer at every forward."""
    model, tok = tiny
    args = dict(prompt_interval=kp, response_interval=kr, transfer_ratio=ratio)
    for prompt in PROMPTS[1:3]:  # the longest answers: most decisions per decode
        ids = encode_prompts(tok, [prompt], chat=True)
        want, forwards, rows = reference_generate(model, ids[0], gen, block, steps, kp, kr, ratio)
        got, stats, got_rows = ours(model, ids, gen, block, steps, **args)
        assert (got[0], stats.nfe, got_rows) == (want, forwards, rows), prompt


def test_refreshing_every_forward_is_no_cache(tiny):
    """Kp = Kr = 1: every forward computes every row at every layer; the same tokens as no cache, batched. The
    store holds K/V and both branch outputs of every row at every layer."""
    model, tok = tiny
    ids = encode_prompts(tok, PROMPTS, chat=True)
    want, plain, _ = ours(model, ids, 32, 8, 32, "none")
    got, stats, _ = ours(model, ids, 32, 8, 32, prompt_interval=1, response_interval=1)
    assert got == want and stats.nfe == stats.full_forwards == plain.nfe
    assert stats.rows_per_layer == plain.rows_per_layer
    cfg, rows = model.config, len(ids) * (max(map(len, ids)) + 32)
    assert stats.cache_bytes == cfg.n_layers * rows * (2 * cfg.n_kv_heads * cfg.head_dim + 2 * cfg.hidden_size) * 4


def test_verifying_every_answer_row_is_refreshing_the_answer(tiny):
    """rho = 1 computes every answer row at every layer (keys from the rows, values from V-verify's projection of
    all of them): the tokens of Kr = 1 with the same Kp."""
    model, tok = tiny
    ids = encode_prompts(tok, PROMPTS, chat=True)
    every, _, _ = ours(model, ids, 32, 8, 32, prompt_interval=4, response_interval=3, transfer_ratio=1.0)
    refreshed, _, _ = ours(model, ids, 32, 8, 32, prompt_interval=4, response_interval=1, transfer_ratio=0.0)
    assert every == refreshed


def test_prophet_reads_the_answer_region_over_it():
    """Every row goes through every layer, so every position has its prediction: Prophet's gap over the answer
    region (decoded positions too) runs, and refreshed every forward it decodes as without a cache."""
    model, tok = dllm.load("tiny-llada")
    args = dict(sampler="prophet", answer_start=5, gen_length=32, block_length=32, stop_early=False)
    plain = dllm.generate(model, tok, PROMPTS, **args)
    cached = dllm.generate(model, tok, PROMPTS, cache="dllm_cache",
                           cache_args=dict(prompt_interval=1, response_interval=1), **args)
    assert cached.token_ids == plain.token_ids and cached.stats.nfe == plain.stats.nfe < 32
    dllm.generate(model, tok, PROMPTS, cache="dllm_cache", **args)


def test_padded_rows_decode_as_alone(tiny):
    """V-verify picks each row's rows from its own values: a left-padded batch gives each prompt's tokens alone."""
    model, tok = tiny
    ids = encode_prompts(tok, PROMPTS, chat=True)
    assert len({len(i) for i in ids}) > 1
    args = dict(prompt_interval=4, response_interval=3, transfer_ratio=0.25)
    batch, _, _ = ours(model, ids, 32, 8, 32, **args)
    assert batch == [ours(model, [i], 32, 8, 32, **args)[0][0] for i in ids]
