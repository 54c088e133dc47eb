"""The request bodies of /v1/completions and /v1/chat/completions as typed models (pydantic, which FastAPI brings):
OpenAI's fields and our per-request extensions, described in /openapi.json for client generators and API fuzzers.

A body is checked against its model once, strictly (no "1" for 1, no 1 for true; 4.0 is 4, as JSON Schema counts
integers; null is the field left out), as the first of
`RequestReader.job`'s checks; what a type cannot say (a sampler's name, a parameter's range, one prompt per
request) the reader checks after. A body that does not fit is a one-line `DllmError` naming the field and what
it takes (HTTP 400)."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from ..core.errors import DllmError


def _integral(value: Any) -> Any:
    """A number with no fraction is an integer, as JSON Schema counts them (4.0 for 4); true is not."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_integral)]


def _field(doc: str, **kwargs) -> Any:
    return Field(None, description=doc, **kwargs)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class ContentPart(_Strict):
    """A part of a message's content: only text parts are served."""

    type: str = Field(description='"text" (other part types are refused)')
    text: str | None = _field("the part's text")


class ChatMessage(_Strict):
    role: str = Field(description="system, user or assistant")
    content: str | list[ContentPart] = Field(description="the text, or text parts (joined by newlines)")


class Decoding(_Strict):
    """The fields both endpoints take: OpenAI's, then ours. Any other field is a sampler or cache parameter by name
    (`dllm list samplers`), e.g. `"threshold": 0.9`."""

    model: str | None = _field("the served model's name (GET /v1/models); any other is refused")
    max_tokens: Int | None = _field("answer tokens at most (>= 1): the answer is cut there, finish_reason length")
    max_completion_tokens: Int | None = _field("max_tokens under its newer name")
    temperature: float | None = _field("sampling temperature, a sampler parameter (0: greedy)")
    top_p: float | None = _field("nucleus sampling, for a sampler that takes it (Dream's); else only 1")
    seed: Int | None = _field("the random stream of this request's row (0 .. 2^63-1)")
    stream: bool | None = _field("send server-sent events, a chunk per decoded block")
    stream_options: dict[str, Any] | None = _field("accepted, no effect")
    stop: str | list[str] | None = _field("strings that end the answer (not sent)")
    n: Int | None = _field("answers per request: 1 only")
    user: str | None = _field("accepted, no effect")
    frequency_penalty: float | None = _field("only 0")
    presence_penalty: float | None = _field("only 0")
    store: bool | None = _field("accepted, no effect")
    metadata: dict[str, Any] | None = _field("accepted, no effect")
    service_tier: str | None = _field("accepted, no effect")
    parallel_tool_calls: bool | None = _field("accepted, no effect")
    response_format: Any = _field('not supported: only {"type": "text"}')
    logit_bias: Any = _field("not supported: only {}")
    tools: Any = _field("not supported: only []")
    tool_choice: Any = _field('not supported: only "none"')
    functions: Any = _field("not supported: only []")
    function_call: Any = _field('not supported: only "none"')
    suffix: Any = _field('not supported: only ""')
    echo: Any = _field("not supported: only false")
    best_of: Any = _field("not supported: only 1")
    modalities: Any = _field('not supported: only ["text"]')
    audio: Any = _field("not supported")
    prediction: Any = _field("not supported")
    reasoning_effort: Any = _field("not supported")
    web_search_options: Any = _field("not supported")
    ignore_eos: bool | None = _field("decode every block, past a stop token (vLLM's ignore_eos)")
    sampler: str | None = _field("the sampler (`dllm list samplers`; default: the server's)")
    cache: str | None = _field("the cache (`dllm list caches`; default: the server's)")
    sampler_args: dict[str, Any] | None = _field("the sampler's parameters (also given by name beside it)")
    cache_args: dict[str, Any] | None = _field("the cache's parameters (also given by name beside it)")
    gen_length: Int | None = _field("answer positions, a multiple of block_length (default: the server's)")
    block_length: Int | None = _field("positions decoded together as one block")
    steps: Int | None = _field("decoding steps over the answer (default: gen_length)")
    cfg_scale: float | None = _field("LLaDA's classifier-free guidance (0: none)")
    logits_eos_inf: bool | None = _field("LLaDA's: never propose EOS")
    confidence_eos_eot_inf: bool | None = _field("LLaDA's: commit EOS and EoT predictions last")
    step_events: bool | None = _field('with stream: also an event after every decoding step, {"object": '
                                      '"dllm.step", "step", "block", "forwards", "committed": [[position, id, '
                                      'text], ...], "remasked": [position, ...], "drafts": [[position, id, text], '
                                      '...]} (positions from the answer\'s first; drafts: a uniform-state model\'s '
                                      'tokens not yet committed)')


class CompletionRequest(Decoding):
    """POST /v1/completions: a raw prompt, as `dllm generate --no-chat`."""

    prompt: str | list[str] | list[Int] = Field(description="the text (or a list of one), or its token ids")
    logprobs: Int | None = _field("alternatives per answer token to return with its log-probability (0 .. 20)")


class ChatRequest(Decoding):
    """POST /v1/chat/completions: messages through the tokenizer's chat template, as `dllm generate`."""

    messages: list[ChatMessage] = Field(min_length=1, description="the conversation so far")
    logprobs: bool | None = _field("return each answer token's log-probability")
    top_logprobs: Int | None = _field("alternatives per token with logprobs: true (0 .. 20)")


EXPECTS = {  # what a field takes, in an error message (after "must be")
    "model": "a string", "max_tokens": "an integer", "max_completion_tokens": "an integer",
    "temperature": "a number", "top_p": "a number", "seed": "an integer", "stream": "true or false",
    "stream_options": "a JSON object", "stop": "a string or a list of non-empty strings", "n": "an integer",
    "user": "a string", "frequency_penalty": "a number", "presence_penalty": "a number", "store": "true or false",
    "metadata": "a JSON object", "service_tier": "a string", "parallel_tool_calls": "true or false",
    "ignore_eos": "true or false", "sampler": "a sampler's name", "cache": "a cache's name",
    "sampler_args": "a JSON object of parameters", "cache_args": "a JSON object of parameters",
    "gen_length": "an integer", "block_length": "an integer", "steps": "an integer", "cfg_scale": "a number",
    "logits_eos_inf": "true or false", "confidence_eos_eot_inf": "true or false", "step_events": "true or false",
    "prompt": "a string (or a list of token ids)", "logprobs": "an integer", "top_logprobs": "an integer",
    "messages": 'a non-empty list of {"role": ..., "content": "text"} objects',
}
CHAT_EXPECTS = {"logprobs": "logprobs must be true or false on /v1/chat/completions, got {value}; send "
                            "top_logprobs: k for alternatives"}


def read(body: Any, chat: bool) -> dict[str, Any]:
    """`body` (a parsed JSON value) checked against its endpoint's model; the fields it gave (DllmError: the first
    that does not fit, one line)."""
    model = ChatRequest if chat else CompletionRequest
    try:
        return model.model_validate(body).model_dump(exclude_unset=True, exclude_none=True)
    except ValidationError as e:
        raise DllmError(_message(e.errors()[0], body, chat)) from None


def _message(error: dict, body: Any, chat: bool) -> str:
    if not error["loc"]:
        return "the request body must be a JSON object"
    name = error["loc"][0]
    if error["type"] == "missing" and len(error["loc"]) == 1:
        return f"{name} is missing; give {EXPECTS[name]}"
    if name == "gen_length" and body[name] == "auto":
        return ("gen_length auto (DAEDAL) is not served: it grows each answer while decoding, and the server "
                "batches rows of fixed lengths between blocks; send gen_length as a number (or leave it out)")
    value = f"{body[name]!r:.80}"
    expects = CHAT_EXPECTS.get(name) if chat else None
    return expects.format(value=value) if expects else f"{name} must be {EXPECTS[name]}, got {value}"
