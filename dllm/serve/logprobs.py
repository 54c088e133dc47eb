"""OpenAI's `logprobs` objects from the engine's `TokenLogprob`s, built off the engine thread: `/v1/completions`'
`{tokens, token_logprobs, top_logprobs, text_offset}` and `/v1/chat/completions`' `{content: [{token, logprob,
bytes, top_logprobs}]}`, one per response or per streamed chunk (offsets continue from chunk to chunk)."""
from __future__ import annotations

import math

from ..engine.logprobs import TokenLogprob
from ..engine.text import answer_text

FLOOR = -9999.0  # what a token outside a truncated distribution (-inf, Dream's top-p/top-k) reports, as vLLM does:
# JSON has no infinity


class LogprobsFormat:
    """One request's logprobs, chunk by chunk: `__call__(tokens)` formats the next tokens of its answer."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer, self.chat = tokenizer, chat
        self.ids: list[int] = []  # the answer's tokens formatted so far (for text offsets)

    def __call__(self, tokens: list[TokenLogprob]) -> dict:
        return self._chat(tokens) if self.chat else self._completion(tokens)

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _chat(self, tokens: list[TokenLogprob]) -> dict:
        def entry(token: int, logprob: float) -> dict:
            text = self._text(token)
            return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}
        return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(*other) for other in t.top]}
                            for t in tokens]}

    def _completion(self, tokens: list[TokenLogprob]) -> dict:
        offsets = []
        for t in tokens:  # where each token's text starts in the completion's text
            offsets.append(len(answer_text(self.tokenizer, self.ids)))
            self.ids.append(t.token)
        return {"tokens": [self._text(t.token) for t in tokens],
                "token_logprobs": [_finite(t.logprob) for t in tokens],
                "top_logprobs": [{self._text(i): _finite(v) for i, v in [*t.top, (t.token, t.logprob)]}
                                 for t in tokens],  # the chosen token too (OpenAI: up to logprobs + 1 entries)
                "text_offset": offsets}


def _finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR
