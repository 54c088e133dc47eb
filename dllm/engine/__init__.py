"""The engine: one decode loop for every sampler, cache and model.

Data flows through its rooms in this order: `options` turns a call's keywords into a sampler, a cache and the
lengths (and `LoopOptions`, the loop's switches); `text` turns prompts into token ids; `checks` refuses what cannot
decode together; `loop` lays the rows out on a `canvas` where its `layouts` policy puts them and decodes them block
by block, each step a `runner` forward of the rows the cache chose and the sampler's commits, counted in `stats`
(`lockstep`: the same batch on every rank of a tensor-parallel model; `decoding` makes either); `api` (`generate`,
`stream`) returns the answers' text, and its `likelihood` an answer's log-likelihood. Beside it: `likelihood` (the
ELBO of a continuation, which that call estimates) and `bench` (`dllm bench`).
"""
from .api import Generation, Stream, generate, stream
from .decoding import decode
from .loop import Batch
from .options import LoopOptions
from .stats import Stats

__all__ = ["Batch", "Generation", "LoopOptions", "Stats", "Stream", "decode", "generate", "stream"]
