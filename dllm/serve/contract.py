"""/openapi.json as the contract of one server: the request bodies (`bodies`) with what this server takes in
them (the served model's name, the samplers and caches it can decode with and which go together, each sampler's and
cache's parameters with their types and ranges, bounds and lengths), and every answer: the completion, the
server-sent events, the error body of each 4xx and 5xx, the Prometheus text of /metrics.

What a schema cannot say stays with the server's checks (one-line 400s): a prompt that does not fit the model's
context with its answer, gen_length a multiple of block_length and steps of the blocks, a sampler's parameters
that depend on the layout."""
from __future__ import annotations

import math
from typing import Any

from ..cache import CACHES
from ..core.errors import DllmError
from ..core.params import FLOAT_LARGEST, FLOAT_SMALLEST, INT_LARGEST, _options, _params, type_hints
from ..engine.checks import check_policies
from ..engine.options import decoding_lengths
from ..samplers import SAMPLERS
from .requests import NEUTRAL, SERVER_ONLY, UNSUPPORTED

JSON_TYPES = {float: "number", int: "integer", bool: "boolean", str: "string"}

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "code"], "properties": {
        "message": {"type": "string", "description": "one line: what is wrong and the fix"},
        "type": {"type": "string", "enum": ["invalid_request_error", "rate_limit_error", "unavailable",
                                           "server_error"]},
        "code": {"type": "integer"}}}}}

ERRORS = {  # status: when
    "400": "the request cannot be decoded as sent (the message names the field and the fix)",
    "413": "the body is larger than 4 MiB",
    "429": "--max-waiting requests wait already (Retry-After: seconds)",
    "500": "the engine failed while decoding it",
    "503": "the server is starting, draining (SIGTERM) or restarting its engine: send it elsewhere or retry",
}

USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
    k: {"type": "integer", "minimum": 0} for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}


def param_schema(cls, name: str) -> dict:
    """A sampler's or cache's parameter as JSON Schema: its type, its range or choices."""
    field = next(f for f in _params(cls) if f.name == name)
    options = _options(type_hints(cls)[name])
    kind = next(t for t in options if t is not type(None))
    schema: dict[str, Any] = {"type": JSON_TYPES[kind], "description": field.metadata.get("doc", "")}
    m = field.metadata
    for key, word in (("ge", "minimum"), ("le", "maximum"), ("gt", "exclusiveMinimum"), ("lt", "exclusiveMaximum")):
        if m.get(key) is not None and not math.isinf(m[key]):
            schema[word] = m[key]
    if kind is int:
        schema.setdefault("minimum", -INT_LARGEST)
        schema.setdefault("maximum", INT_LARGEST)
    if kind is float:
        schema = {**float_schema(schema), "description": schema["description"]}
    if m.get("choices"):
        schema["enum"] = list(m["choices"])
    return {"anyOf": [schema, {"type": "null"}]} if type(None) in options else schema


def float_schema(bounds: dict) -> dict:
    """A float within `bounds` (JSON Schema's minimum, maximum, exclusive ones) that `Params` takes: 0, or a
    magnitude between FLOAT_SMALLEST and FLOAT_LARGEST."""
    low = max(bounds.get("minimum", -FLOAT_LARGEST), bounds.get("exclusiveMinimum", -FLOAT_LARGEST), -FLOAT_LARGEST)
    high = min(bounds.get("maximum", FLOAT_LARGEST), bounds.get("exclusiveMaximum", FLOAT_LARGEST), FLOAT_LARGEST)
    exclusive = {k: v for k, v in bounds.items() if k.startswith("exclusive")}
    parts = []
    if bounds.get("minimum", -1) <= 0 <= bounds.get("maximum", 1) and "exclusiveMinimum" not in bounds:
        parts.append({"type": "number", "const": 0})
    if high >= FLOAT_SMALLEST:
        parts.append({"type": "number", "minimum": max(low, FLOAT_SMALLEST), "maximum": high, **{
            k: v for k, v in exclusive.items() if v >= FLOAT_SMALLEST}})
    if low <= -FLOAT_SMALLEST:
        parts.append({"type": "number", "minimum": low, "maximum": min(high, -FLOAT_SMALLEST)})
    return parts[0] if len(parts) == 1 else {"anyOf": parts}


def served(model, tokenizer, default_cache: str, compile: bool) -> dict[str, list[str]]:
    """Each sampler that decodes this model, with the caches it decodes with (at their defaults)."""
    caches = {name: CACHES.create(name) for name in CACHES.classes}
    out = {}
    for name in SAMPLERS.classes:
        if name == "daedal":
            continue
        try:
            sampler = SAMPLERS.create(name)
            sampler.prepare(tokenizer)  # (what it reads beside the model, e.g. PC-Sampler's token frequencies)
        except DllmError:
            continue
        works = []
        for cache_name, cache in caches.items():
            try:
                check_policies(model, sampler, cache, compile)
                works.append(cache_name)
            except DllmError:
                pass
        if default_cache in works:
            out[name] = works
    return out


def decoding_values(model, sampler: str, name: str, schema: dict, cache: str, compile: bool) -> dict:
    """A sampler parameter's `schema` with, for a switch or a choice, only the values that decode this model (e.g.
    `causal_first`, which only a Nemotron-Diffusion model takes)."""
    plain = schema.get("anyOf", [schema])[0]
    values = [False, True] if plain.get("type") == "boolean" else plain.get("enum")
    if not values:
        return schema
    works = []
    for value in values:
        try:
            check_policies(model, SAMPLERS.create(sampler, **{name: value}), CACHES.create(cache), compile)
            works.append(value)
        except DllmError:
            pass
    if works == values:
        return schema
    narrowed = {**plain, "enum": works}
    return {"anyOf": [narrowed, {"type": "null"}]} if "anyOf" in schema else narrowed


def _text(tokenizer, room: int) -> dict:
    """Text this tokenizer reads: any with a character that is not a space, or for a tokenizer whose every token
    is one character (the tiny models'), those characters, at most `room` of them."""
    special = set(tokenizer.all_special_tokens)
    vocab = [t for t in tokenizer.get_vocab() if t not in special]
    if not vocab or any(len(t) != 1 for t in vocab):
        return {"type": "string", "pattern": r"\S"}
    def among(chars):
        return "".join("\\" + c if c in "\\]-[^" else c for c in sorted(chars))

    return {"type": "string", "maxLength": room,
            "pattern": f"^[{among(vocab)}]*[{among(c for c in vocab if not c.isspace())}][{among(vocab)}]*$"}


def prompt_room(reader) -> int:
    """The prompt tokens that leave room for the server's default answer in the model's context (a shorter answer
    leaves more: the server checks the sum)."""
    answer = decoding_lengths(reader.model, reader.defaults["gen_length"], reader.defaults["block_length"],
                              reader.defaults["steps"])["gen_length"]
    return max(1, reader.model.config.max_length - answer)


def shortest_prompt(reader, chat: bool) -> int:
    """The tokens of a one-character prompt (its chat template's, on the chat endpoint)."""
    body = {"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"}
    try:
        return len(reader._prompt_ids(body, chat))
    except DllmError:  # (a tokenizer without "x" or a chat template: the schema still bounds the answer)
        return 1


MESSAGES, PARTS = 4, 4  # the most messages, and text parts of one message, a schema with bounded text lets through


def chat_text_room(reader, room: int) -> tuple[int, int]:
    """The characters one message's content may hold, and one of its text parts, so that MESSAGES messages of
    PARTS parts each, in the chat template, fit `room` tokens (for a tokenizer whose tokens are characters)."""
    def tokens(roles):
        return len(reader._prompt_ids({"messages": [{"role": r, "content": "x"} for r in roles]}, chat=True))

    roles = ("system", "user", "assistant")
    first = max(tokens([r]) for r in roles) - 1
    more = max(tokens([a, b]) - tokens([a]) - 1 for a in roles for b in roles)
    content = max(1, (room - first - (MESSAGES - 1) * more) // MESSAGES)
    return content, max(1, (content - (PARTS - 1)) // PARTS)  # (parts join with newlines)


def length_rules(reader, longest: int) -> tuple[list[int], list[dict]]:
    """The block lengths a request may send (powers of two whose answers are their multiples, checked on the
    model) and the rules that tie gen_length to them, as JSON Schema if/then: gen_length a multiple of
    block_length, and a block that does not divide the server's default answer needs gen_length or max_tokens
    beside it. What stays with the server: steps a multiple of the blocks."""
    d = reader.defaults

    def valid(gen, block):
        try:
            decoding_lengths(reader.model, gen, block, None)
            return True
        except DllmError:
            return False

    default_gen = decoding_lengths(reader.model, d["gen_length"], d["block_length"], d["steps"])["gen_length"]
    blocks, rules = [], []
    for block in (2 ** i for i in range(longest.bit_length())):
        multiples = [g for g in (block, 2 * block, 3 * block, longest // block * block) if g <= longest]
        if not all(valid(g, block) for g in multiples) or (block > 1 and valid(block + 1, block)):
            continue
        blocks.append(block)
        multiple = {"anyOf": [{"type": "integer", "multipleOf": block}, {"type": "null"}]}
        then: dict = {"properties": {"gen_length": multiple}}
        if default_gen % block:
            then["anyOf"] = [{"required": [name], "properties": {name: {"type": "integer"}}}
                             for name in ("gen_length", "max_tokens", "max_completion_tokens")]
        rules.append({"if": {"properties": {"block_length": {"const": block}}, "required": ["block_length"]},
                      "then": then})
    if not all(valid(g, d["block_length"]) for g in (1, 3, 7, longest)):  # gen_length alone: the default block's
        block = decoding_lengths(reader.model, d["gen_length"], d["block_length"], d["steps"])["block_length"]
        rules.append({"if": {"not": {"required": ["block_length"]}}, "then": {"properties": {"gen_length": {
            "anyOf": [{"type": "integer", "multipleOf": block}, {"type": "null"}]}}}})
    return blocks, rules


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def tighten(body: dict, reader, chat: bool, components: dict) -> None:
    """`body` (a request body's JSON Schema from `bodies`) with this server's values, ranges and the samplers'
    and caches' parameters; no property beyond those listed."""
    model, d = reader.model, reader.defaults
    context = model.config.max_length
    room = prompt_room(reader)
    offered = served(model, reader.tokenizer, d["cache"], reader.compile)
    props = body["properties"]
    longest = context - shortest_prompt(reader, chat)
    blocks, length_ties = length_rules(reader, longest)
    count = {"type": "integer", "minimum": 1, "maximum": longest}
    exact = {
        "model": {"type": "string", "enum": [reader.name]},
        "max_tokens": count, "max_completion_tokens": count,
        "temperature": float_schema({"minimum": 0}),
        "seed": {"type": "integer", "minimum": 0, "maximum": 2 ** 63 - 1},
        "stop": {"anyOf": [{"type": "string", "minLength": 1},
                           {"type": "array", "items": {"type": "string", "minLength": 1}}]},
        "n": {"type": "integer", "enum": [1]},
        "sampler": {"type": "string", "enum": sorted(offered)},
        "cache": {"type": "string", "enum": sorted(CACHES.classes)},
        "gen_length": count, "block_length": {"type": "integer", "enum": blocks}, "steps": count,
        "cfg_scale": {"type": "number", "minimum": 0},
        **{name: {"enum": [neutral]} for name, neutral in NEUTRAL.items()},
        **{name: {"enum": unused} for name, unused in UNSUPPORTED.items()},
    }
    text = _text(reader.tokenizer, room)
    if chat:
        exact["top_logprobs"] = {"type": "integer", "minimum": 0, "maximum": 20}
        if "maxLength" in text:  # (text the schema bounds: as many messages as chat_text_room counts on)
            exact["messages"] = {**props["messages"], "maxItems": MESSAGES}
    else:
        exact["logprobs"] = {"type": "integer", "minimum": 0, "maximum": 20}
        exact["prompt"] = {"anyOf": [text, {"type": "array", "items": text, "minItems": 1, "maxItems": 1}, {
            "type": "array", "minItems": 1, "maxItems": room,
            "items": {"type": "integer", "minimum": 0, "maximum": model.config.vocab_size - 1}}]}
    for name, schema in exact.items():
        value = schema if name in body.get("required", ()) else _nullable(schema)
        props[name] = {**value, "description": props[name].get("description", "")}
    by_name = sorted({p for name in offered for p in SAMPLERS.get(name).param_names()} - set(props))
    cache_params = {p: param_schema(cls, p) for cls in CACHES.classes.values() for p in cls.param_names()}
    components["CacheArgs"] = {"type": "object", "properties": cache_params, "additionalProperties": False,
                               "description": "the cache's parameters (`dllm list caches`); another cache's are "
                                              "refused"}
    cache_args = _nullable({"$ref": "#/components/schemas/CacheArgs"})
    branches = []
    for name, caches in offered.items():
        cls = SAMPLERS.get(name)
        own = {p: decoding_values(model, name, p, param_schema(cls, p), d["cache"], reader.compile)
               for p in cls.param_names() if p not in SERVER_ONLY}
        branch = {**props, **{p: own[p] for p in own if p in by_name or p in NEUTRAL}}
        branch.update({p: _nullable({"enum": [neutral]}) for p, neutral in NEUTRAL.items() if p not in own})
        branch["sampler"] = {"enum": [name, None]} if name == d["sampler"] else {"const": name}
        branch["sampler_args"] = _nullable({"type": "object", "properties": own, "additionalProperties": False})
        branch["cache"] = _nullable({"type": "string", "enum": caches})
        branch["cache_args"] = cache_args
        if cls.slides:  # (its window has no blocks and no steps: `settle` refuses them)
            branch.update(block_length={"type": "null"}, steps={"type": "null"})
        required = body.get("required", []) + ([] if name == d["sampler"] else ["sampler"])
        branches.append({"type": "object", "title": f"sampler {name}", "properties": branch, "required": required,
                         "additionalProperties": False})
    described = {k: body[k] for k in ("title", "description") if k in body}
    body.clear()
    body.update(described, oneOf=branches)
    body["allOf"] = [  # step events ride the stream; cache_args holds the chosen cache's parameters only
        {"if": {"properties": {"step_events": {"const": True}}, "required": ["step_events"]},
         "then": {"properties": {"stream": {"const": True}}, "required": ["stream"]}},
        *({"if": {"properties": {"cache": {"const": name}}, "required": ["cache"]} if name != d["cache"] else
           {"if": {"properties": {"cache": {"enum": [name, None]}}}},
          "then": {"properties": {"cache_args": _nullable({"type": "object", "additionalProperties": False,
                                                            "properties": {p: param_schema(cls, p)
                                                                           for p in cls.param_names()}})}}}
          for name, cls in CACHES.classes.items()), *length_ties]
    if chat:
        body["dependentSchemas"] = {"top_logprobs": {"properties": {"logprobs": {"const": True}},
                                                     "required": ["logprobs"]}}


def _answer(chat: bool) -> dict:
    """A whole answer's body."""
    choice = {"type": "object", "required": ["index", "finish_reason"], "properties": {
        "index": {"type": "integer"}, "finish_reason": {"type": "string", "enum": ["stop", "length"]},
        "logprobs": {"anyOf": [{"type": "object"}, {"type": "null"}]},
        **({"message": {"type": "object", "required": ["role", "content"], "properties": {
            "role": {"const": "assistant"}, "content": {"type": "string"}}}} if chat else
           {"text": {"type": "string"}})}}
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
        "id": {"type": "string"}, "object": {"const": "chat.completion" if chat else "text_completion"},
        "created": {"type": "integer"}, "model": {"type": "string"},
        "choices": {"type": "array", "items": choice, "minItems": 1, "maxItems": 1}, "usage": USAGE}}


def _event(chat: bool) -> dict:
    """One server-sent event (as schemathesis and OpenAPI 3.2 read a stream): its data, a JSON chunk (text, or the
    finish reason with usage), a JSON error object, or [DONE]."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"type": "object", "required": ["data"], "properties": {"data": {
        "type": "string", "description": f"a {kind} chunk (JSON), an error (JSON), or [DONE] at the end"}}}


def _errors(*statuses: str) -> dict:
    return {status: {"description": ERRORS[status], "content": {"application/json": {"schema": ERROR}}}
            for status in statuses}


def declare(schema: dict, reader) -> dict:
    """FastAPI's /openapi.json (`schema`) made this server's contract."""
    components = schema["components"]["schemas"]
    request_id = {"name": "X-Request-ID", "in": "header", "required": False, "description":
                  "echoed on the answer (else the server makes one) and named in the engine's log lines",
                  "schema": {"type": "string", "pattern": "^[!-~]{1,128}$"}}
    for path, chat in (("/v1/completions", False), ("/v1/chat/completions", True)):
        tighten(components["ChatRequest" if chat else "CompletionRequest"], reader, chat, components)
        operation = schema["paths"][path]["post"]
        operation["parameters"] = [request_id]
        operation["responses"] = {
            "200": {"description": "the answer; with stream: true, server-sent events (a chunk per decoded block, "
                                   "then the finish reason and usage, then data: [DONE])",
                    "content": {"application/json": {"schema": _answer(chat)},
                                "text/event-stream": {"schema": _event(chat)}}},
            **_errors("400", "413", "429", "500", "503")}
    room = prompt_room(reader)
    text = _text(reader.tokenizer, room)
    if "maxLength" in text:
        content_room, part_room = chat_text_room(reader, room)
        text, part_text, parts = {**text, "maxLength": content_room}, {**text, "maxLength": part_room}, PARTS
    else:
        part_text, parts = text, None
    message = components["ChatMessage"]["properties"]
    message["role"] = {"type": "string", "enum": ["system", "user", "assistant"], "description": "who says it"}
    message["content"] = {"anyOf": [text, {"type": "array", "minItems": 1, "items": {
        "$ref": "#/components/schemas/ContentPart"}, **({"maxItems": parts} if parts else {})}],
        "description": message["content"].get("description", "")}
    part = components["ContentPart"]
    part["properties"] = {"type": {"type": "string", "enum": ["text"]}, "text": part_text}
    part["required"] = ["type", "text"]
    status = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}
    for path, doc in (("/health", "the process and its engine process run (also while draining)"),
                      ("/ready", "requests are taken: the model is loaded and the engine answers")):
        schema["paths"][path]["get"]["responses"] = {
            "200": {"description": doc, "content": {"application/json": {"schema": status}}},
            **_errors("400", "503")}
    schema["paths"]["/metrics"]["get"]["responses"] = {"200": {
        "description": "Prometheus metrics (text exposition format 0.0.4)",
        "content": {"text/plain; version=0.0.4; charset=utf-8": {"schema": {"type": "string"}}}},
        **_errors("400")}
    schema["paths"]["/v1/models"]["get"]["responses"] = {"200": {"description": "the served model", "content": {
        "application/json": {"schema": {"type": "object", "required": ["object", "data"], "properties": {
            "object": {"const": "list"}, "data": {"type": "array", "items": {"type": "object", "required": ["id"],
                                                                            "properties": {"id": {"type": "string"}}}}}}}}},
        **_errors("400")}
    return schema

