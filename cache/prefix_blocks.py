"""A prefix cache across generations for block-causal models (SDAR, LLaDA2, Fast-dLLM v2) and causal-prefix ones
(Nemotron-Labs-Diffusion, DiffusionGemma): the keys and values of whole attention blocks, kept after a generation and
reused by any later one whose tokens start the same way.

Why it is exact: under block-causal attention a block attends only to itself and earlier blocks, so its keys and
values are a function of the tokens from the sequence start through its end, at their positions (under causal-prefix
attention every token before the block being decoded attends causally, so any run of tokens is such a block: they
are kept in chunks of `CAUSAL_CHUNK`). Keys are stored
after RoPE, and the canvas gives every row RoPE positions counted from its first real token, so left padding (rows
are shifted to align their current blocks) moves a block to other columns but never changes its keys and values;
padding columns are masked out of attention. A block is therefore keyed by a hashed chain, as vLLM's automatic
prefix caching keys its pages: block j's key hashes block j-1's key and block j's tokens. Only whole blocks before a
row's current block are kept or reused: the block a prompt ends in also holds answer masks, and under full attention
(LLaDA, Dream) every prompt key depends on the answer canvas, so there is nothing to reuse.

Used with the `block` cache, whose store marks the columns that hold final keys and values (`final`): `load` fills
them from kept blocks before the first forward of a layout, `save` keeps them once a block's forward made them
final. Past `mib` MiB (checked after each `save`) the least recently used blocks go; a chain is marked used from
its end to its front, so it loses its end first and keeps what a lookup, which stops at the first missing block,
can use."""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import torch
from torch import Tensor

from dllm.core.errors import DllmError

from .base import KVStore

CAUSAL_CHUNK = 16  # tokens per kept block on a causal-prefix model (vLLM's page size)


class PrefixBlocks:
    """Kept keys and values of whole blocks, each layer's keys then each layer's values (`[kv heads, block, head
    dim]`, per layer: DiffusionGemma's full layers differ from its sliding ones), keyed by token chains.
    Counts the tokens asked for (`queried`: whole blocks before rows' current blocks, at each layout), the tokens
    served (`hits`), blocks evicted and bytes held."""

    def __init__(self, model, mib: float):
        cfg = model.config
        if not cfg.decoded_keys_fixed:
            raise DllmError(f"a prefix cache needs a block-causal or causal-prefix model (SDAR, LLaDA2, Fast-dLLM v2, "
                            f"Nemotron-Labs-Diffusion, DiffusionGemma): under {cfg.arch}'s full attention a prompt's "
                            f"keys and values depend on the answer; drop --prefix-cache-mb (prefix_cache)")
        if isinstance(mib, bool) or not isinstance(mib, (int, float)) or not mib > 0:
            raise DllmError(f"the prefix cache size must be a positive number of MiB, got {mib!r}")
        self.model, self.size, self.capacity = model, cfg.block_size or CAUSAL_CHUNK, int(mib * 2**20)
        self.blocks: OrderedDict[bytes, tuple[Tensor, ...]] = OrderedDict()  # least recently used first
        self.nbytes = self.queried = self.hits = self.evicted = 0

    def keys(self, tokens: list[int]) -> list[bytes]:
        """The chain keys of the whole blocks of `tokens`."""
        keys, key = [], b""
        for start in range(0, len(tokens) - self.size + 1, self.size):
            key = hashlib.blake2b(key + array("q", tokens[start:start + self.size]).tobytes(), digest_size=16).digest()
            keys.append(key)
        return keys

    def _kept(self, keys: list[bytes]) -> int:
        """How many of `keys` are kept from the first on."""
        return next((i for i, key in enumerate(keys) if key not in self.blocks), len(keys))

    def _used(self, keys: list[bytes]) -> None:
        """Mark a chain's kept blocks used, its first most recently: a chain is evicted from its end."""
        for key in reversed(keys):
            if key in self.blocks:
                self.blocks.move_to_end(key)

    def load(self, kv: KVStore, prefixes: list[list[int]], columns: list[int]) -> None:
        """Before a layout's first forward: write into `kv` each row's kept blocks of `prefixes[b]` (its tokens before
        its current block, from canvas column `columns[b]`), and set `kv.final` to the first column a row still needs
        computed."""
        final = None
        for b, (tokens, column) in enumerate(zip(prefixes, columns)):
            keys = self.keys(tokens)
            count = self._kept(keys)
            self._used(keys[:count])
            self.queried += len(keys) * self.size
            self.hits += count * self.size
            if count:
                end = column + count * self.size
                for store, parts in zip((*kv.k, *kv.v), zip(*(self.blocks[key] for key in keys[:count]))):
                    store[b, :, column:end] = torch.cat(parts, dim=-2)
            final = column + count * self.size if final is None else min(final, column + count * self.size)
        kv.final = final

    def save(self, kv: KVStore, prefixes: list[list[int]], columns: list[int]) -> None:
        """After a forward made the columns before `kv.final` final: keep every row's whole blocks there that are not
        kept yet (`prefixes[b]`: row b's tokens from column `columns[b]` to `kv.final`), then evict least recently
        used blocks down to the bound."""
        for b, (tokens, column) in enumerate(zip(prefixes, columns)):
            keys = self.keys(tokens)
            new = self._kept(keys)
            for j, key in enumerate(keys[new:], new):
                if key not in self.blocks:  # a block after an evicted one may still be kept
                    cols = slice(column + j * self.size, column + (j + 1) * self.size)
                    block = self.blocks[key] = tuple(store[b, :, cols].clone() for store in (*kv.k, *kv.v))
                    self.nbytes += _nbytes(block)
            self._used(keys)
        while self.nbytes > self.capacity:
            _, dropped = self.blocks.popitem(last=False)
            self.nbytes -= _nbytes(dropped)
            self.evicted += 1


def _nbytes(block: tuple[Tensor, ...]) -> int:
    return sum(t.numel() * t.element_size() for t in block)
