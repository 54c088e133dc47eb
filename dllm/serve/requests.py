"""An OpenAI request body to a `Job`: the fields we take, the decoding parameters riding next to them, every check
that can fail before the request is queued (HTTP 400 with the CLI's one-line message), run in the HTTP process on the
model without its weights; the job's `message` is what the engine process decodes, and `read` makes the text of the
tokens it sends back."""
from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import dllm.serve.bodies as bodies

from ..cache import CACHES
from ..core.checks import check_int, check_seed
from ..core.errors import DllmError
from ..engine.canvas import Canvas
from ..engine.checks import check_policies
from ..engine.guidance import Guidance
from ..engine.logprobs import check_logprobs
from ..engine.options import decoding_lengths, lengths_for_answer, settle
from ..engine.text import answer_text, check_plain_text, encode_prompts, warn_outside_format
from ..samplers import SAMPLERS
from .messages import Add, StepEvent

OPENAI_FIELDS = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "seed", "stream",
                 "n", "stop", "user", "stream_options", "ignore_eos",  # ignore_eos as vLLM: decode every block
                 "top_p", "frequency_penalty", "presence_penalty", "logprobs", "top_logprobs",
                 "store", "metadata", "service_tier", "parallel_tool_calls"}  # bookkeeping: no effect on the answer

NEUTRAL = {"top_p": 1, "frequency_penalty": 0, "presence_penalty": 0}  # what clients send by default; no other value
# (top_p goes to a sampler that takes it: Dream's)

UNSUPPORTED = {  # OpenAI fields this server does not implement, with the values that leave them unused
    "response_format": [{"type": "text"}], "logit_bias": [{}], "tools": [[]], "tool_choice": ["none"],
    "functions": [[]], "function_call": ["none"], "suffix": [""], "echo": [False], "best_of": [1],
    "modalities": [["text"]], "audio": [], "prediction": [], "reasoning_effort": [], "web_search_options": []}

ROLES = ("system", "user", "assistant")
SERVER_ONLY = {"frequency_file"}  # sampler parameters that name a file on the server: set by `dllm serve`'s flags only

LAYOUT_FIELDS = ("gen_length", "block_length", "steps")

GUIDANCE_FIELDS = tuple(Guidance().config())  # LLaDA's cfg_scale, logits_eos_inf, confidence_eos_eot_inf


def _stop_start(text: str, stops: list[str]) -> int:
    """The length of the longest end of `text` that begins one of `stops` (0 if none)."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def _shortest_prefix(tokenizer, ids: list[int], holds) -> int:
    """The fewest of `ids` (1..len) whose text `holds`, a test that stays true for every longer prefix once true
    (len(ids) if none does)."""
    low, high = 1, len(ids)
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if holds(answer_text(tokenizer, ids[:mid])) else (mid + 1, high)
    return low


def _tokens_through_stop(tokenizer, ids: list[int], stops: list[str]) -> int:
    """How many of `ids` it takes for the text to contain one of `stops` (as vLLM counts a stopped completion)."""
    return _shortest_prefix(tokenizer, ids, lambda text: any(s in text for s in stops))


def _tokens_in_text(tokenizer, ids: list[int], length: int) -> int:
    """How many of `ids` have their text within its first `length` characters."""
    if not ids or len(answer_text(tokenizer, ids)) <= length:
        return len(ids)
    return _shortest_prefix(tokenizer, ids, lambda text: len(text) > length) - 1


@dataclass
class Job:
    """One request in the HTTP process: what to decode (`message`, for the engine process) and where its events go.
    The engine's deltas build `answer` (and `answer_logprobs`) block by block; `read` turns them into text, stop
    strings, the finish reason and usage."""

    ids: list[int]
    lengths: dict[str, int | None]
    max_tokens: int | None
    seed: int
    sampler: Any
    cache: Any
    stop: list[str]
    stream: bool
    chat: bool
    steps_per_block: int = 0
    stop_early: bool = True
    logprobs: int | None = None  # alternatives per answer token with its log-probability (None: none asked)
    logprobs_sent: int = 0  # answer tokens whose log-probabilities were sent
    request_id: str = ""  # the client's X-Request-ID, or the server's
    guidance: Guidance = Guidance()
    step_events: bool = False  # stream an event after every decoding step (`step`)
    events: asyncio.Queue | None = None  # what the HTTP handler reads: {"kind": "delta", "text", "logprobs"},
    # {"kind": "done", "text", "finish_reason", "usage", "logprobs"}, {"kind": "error", "status", "message"} or,
    # with step_events, {"kind": "step", ...} (`step`)
    complete: bool = False  # the answer is complete (a stop string, or the engine's last block): the row can stop
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: float = field(default_factory=time.time)
    submitted: float = field(default_factory=time.perf_counter)
    first_block: float | None = None
    text: str = ""  # answer text sent so far
    answer: list[int] = field(default_factory=list)  # the answer's tokens the engine has sent
    answer_logprobs: list = field(default_factory=list)  # their `TokenLogprob`s (when asked)

    def message(self) -> Add:
        """What the engine process decodes."""
        return Add(self.id, self.ids, self.lengths["gen_length"], self.lengths["block_length"], self.steps_per_block,
                   self.sampler.config(), self.cache.config(), self.guidance.config(), self.seed, self.max_tokens,
                   self.stop_early, self.logprobs, self.step_events, self.request_id)

    def step(self, tokenizer, event: StepEvent) -> dict:
        """A step event for the stream: its step, block and forwards, and its positions with their tokens' ids and
        texts (`committed`, `drafts`: `[position, id, text]`; `remasked`: positions)."""
        def tokens(pairs):
            return [[p, t, answer_text(tokenizer, [t])] for p, t in pairs]

        return {"kind": "step", "step": event.step, "block": event.block, "forwards": event.forwards,
                "committed": tokens(event.committed), "remasked": event.remasked, "drafts": tokens(event.drafts)}

    def read(self, tokenizer, ids: list[int], done: bool, reason: str, logprobs: list | None = None) -> list[dict]:
        """The events of a block: `ids`, the answer so far (decoded blocks, cut at max_tokens), becomes new text to
        stream; at the end (`done`, or a stop string in the text) the finish reason (`reason` unless a stop string
        ended it) and usage. Text that may begin a stop string, or a character split between blocks, waits.
        `logprobs` (of `ids`, when asked): each event carries those of the tokens whose text it completes."""
        text = answer_text(tokenizer, ids)
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        text = text[:min(hits)] if hits else text
        done = done or bool(hits)
        if not done:
            text = text[:len(text) - _stop_start(text, self.stop)]
        if hits:  # tokens decoded past the stop string are not the answer's
            ids, reason = ids[:_tokens_through_stop(tokenizer, ids, self.stop)], "stop"
        events = []
        if done or not text.endswith("\ufffd"):
            delta, self.text = text[len(self.text):], text
            if delta and self.stream:
                events.append({"kind": "delta", "text": delta, "logprobs": self._logprobs(tokenizer, ids, done,
                                                                                          logprobs)})
        if done:
            self.complete = True
            usage = {"prompt_tokens": len(self.ids), "completion_tokens": len(ids),
                     "total_tokens": len(self.ids) + len(ids)}
            events.append({"kind": "done", "text": self.text, "finish_reason": reason, "usage": usage,
                           "logprobs": self._logprobs(tokenizer, ids, done, logprobs)})
        return events

    def _logprobs(self, tokenizer, ids: list[int], done: bool, logprobs: list | None) -> list | None:
        """The log-probabilities of `ids`' tokens not sent yet whose text has been (all of them once `done`)."""
        if self.logprobs is None:
            return None
        sent = len(ids) if done else _tokens_in_text(tokenizer, ids, len(self.text))
        tokens, self.logprobs_sent = logprobs[self.logprobs_sent:sent], max(sent, self.logprobs_sent)
        return tokens


def served_defaults(model, flags: dict[str, Any]) -> dict[str, Any]:
    """A server's decoding defaults on `model` from its flags (`dllm serve`'s, a Ray replica's options), settled as
    a call's (`settle`: no sampler or cache named gives the model's, with its generation_config.json's and its
    family's parameters); every value is checked."""
    settings = settle(model, flags["sampler"], flags["cache"], {}, flags["sampler_args"], flags["cache_args"],
                      **{k: flags[k] for k in LAYOUT_FIELDS},
                      **{k: flags.get(k, off) for k, off in Guidance().config().items()})
    own = {kind: {k: v for k, v in policy.config().items() if k != "name"}
           for kind, policy in (("sampler", settings.sampler), ("cache", settings.cache))}
    return {**flags, "sampler": settings.sampler.name, "cache": settings.cache.name, "sampler_args": own["sampler"],
            "cache_args": own["cache"], **settings.guidance.config()}


class PreparedSamplers:
    """One prepared sampler object per configuration (the last 32 used): `prepare` reads the tokenizer once (AdaBlock
    scans the whole vocabulary, and refuses delimiters it lacks), and a sampler keeps no per-run state, so requests
    share it. The HTTP process prepares each to check it, the engine process to decode with it."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.samplers: dict[tuple, Any] = {}  # by configuration, least recently used first
        self.lock = threading.Lock()  # requests are read on several threads

    def __call__(self, sampler):
        key = tuple(sampler.config().items())
        with self.lock:
            known = self.samplers.pop(key, None)
        if known is None:
            sampler.prepare(self.tokenizer)
            known = sampler
        with self.lock:
            self.samplers[key] = known
            while len(self.samplers) > 32:
                self.samplers.pop(next(iter(self.samplers)))
        return known


class RequestReader:
    """Reads request bodies into Jobs for one served model (its weights need not be loaded): its name, the
    server's decoding defaults, one prepared sampler per configuration."""

    def __init__(self, model, tokenizer, name: str, defaults: dict[str, Any], compile: bool = False):
        self.model, self.tokenizer, self.name, self.defaults, self.compile = model, tokenizer, name, defaults, compile
        self.prepared = PreparedSamplers(tokenizer)

    def decoding(self) -> dict[str, Any]:
        """What a request may choose (GET /decoding): every sampler and cache with its parameters and defaults (as
        `dllm list --json`), and the server's defaults with the lengths they settle to on this model."""
        d = self.defaults
        settings = settle(self.model, d["sampler"], d["cache"], {}, d["sampler_args"], d["cache_args"],
                          **{k: d.get(k) for k in LAYOUT_FIELDS},
                          **{k: d.get(k, off) for k, off in Guidance().config().items()})
        defaults = {"sampler": d["sampler"], "cache": d["cache"], "sampler_args": d["sampler_args"],
                    "cache_args": d["cache_args"], "seed": d["seed"], **settings.lengths,
                    **settings.guidance.config()}
        return {"model": self.name, "uniform_state": self.model.config.mask_id is None, "defaults": defaults,
                "samplers": [cls.describe() for cls in SAMPLERS], "caches": [cls.describe() for cls in CACHES]}

    def job(self, body: Any, chat: bool) -> Job:
        """Validate a request body (parsed JSON) into a Job (DllmError: the one-line reason): its types against the
        endpoint's model (`bodies`), then what types cannot say."""
        body = bodies.read(body, chat)
        if body.get("model") not in (None, self.name):
            raise DllmError(f"model {body['model']!r} is not served here; this server serves {self.name!r} "
                            f"(GET /v1/models)")
        if body.get("n", 1) != 1:
            raise DllmError(f"n must be 1, got {body['n']!r}; send one request per answer")
        for name, unused in UNSUPPORTED.items():
            if body.get(name) is not None and body[name] not in unused:
                raise DllmError(f"{name} is an OpenAI field this server does not support; drop it")
        sampler_name = body.get("sampler", self.defaults["sampler"])
        takes = SAMPLERS.get(sampler_name).param_names() if isinstance(sampler_name, str) and \
            sampler_name in SAMPLERS.classes else ()
        for name, neutral in NEUTRAL.items():
            if body.get(name, neutral) not in (None, neutral) and name not in takes:
                raise DllmError(f"{name} is not supported by sampler {sampler_name!r} (the sampler decides what to "
                                f"commit); drop it or send {neutral}")
        stream, ignore_eos = bool(body.get("stream")), bool(body.get("ignore_eos"))
        if body.get("step_events") and not stream:
            raise DllmError("step_events streams an event per decoding step; send stream: true with it")
        stop = body.get("stop", [])
        stop = [stop] if isinstance(stop, str) else stop
        if not all(stop):
            raise DllmError(f"stop must be a string or a list of non-empty strings, got {body.get('stop')!r}")
        logprobs = _logprobs(body, chat)
        ids = self._prompt_ids(body, chat)
        params = {k: v for k, v in body.items() if k not in OPENAI_FIELDS and k not in UNSUPPORTED
                  and k not in LAYOUT_FIELDS and k not in GUIDANCE_FIELDS
                  and k not in ("sampler", "cache", "sampler_args", "cache_args", "step_events")}
        params.update({k: body[k] for k in ("temperature", *NEUTRAL) if body.get(k) is not None and k in takes})
        server_only = sorted(SERVER_ONLY & (set(params) | set(body.get("sampler_args") or {})))
        if server_only:
            raise DllmError(f"{server_only[0]} names a file on the server, which a request cannot choose; start dllm "
                            f"serve with --sampler-arg {server_only[0]}=PATH instead")
        d = self.defaults
        same_sampler = body.get("sampler", d["sampler"]) == d["sampler"]
        same_cache = body.get("cache", d["cache"]) == d["cache"]
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None:
            check_int("max_tokens", max_tokens, 1)
        settings = settle(
            self.model, body.get("sampler", d["sampler"]), body.get("cache", d["cache"]), params,
            {**(d["sampler_args"] if same_sampler else {}), **(body.get("sampler_args") or {})},
            {**(d["cache_args"] if same_cache else {}), **(body.get("cache_args") or {})},
            **{k: body.get(k, d.get(k)) for k in LAYOUT_FIELDS},
            **{k: body.get(k, d.get(k, off)) for k, off in Guidance().config().items()})
        sampler, cache, guidance = settings.sampler, settings.cache, settings.guidance
        lengths = lengths_for_answer(settings.lengths, max_tokens)
        lengths = decoding_lengths(self.model, **lengths)  # validated again after rounding
        seed = check_seed(body.get("seed", d["seed"]))
        Canvas.check(self.model, [ids], lengths["gen_length"])  # prompt too long etc.
        check_policies(self.model, sampler, cache, self.compile)
        sampler.check_gen_length(lengths["gen_length"])
        warn_outside_format(self.model, self.tokenizer, [ids])  # in the server's log
        check_logprobs(logprobs, sampler)
        sampler = self.prepared(sampler)
        block, gen = lengths["block_length"], lengths["gen_length"]
        steps_per_block = (lengths["steps"] or gen) // (gen // block)
        return Job(ids, lengths, max_tokens, seed, sampler, cache, stop, stream, chat, steps_per_block=steps_per_block,
                   stop_early=not ignore_eos, logprobs=logprobs, guidance=guidance,
                   step_events=bool(body.get("step_events")))

    def _prompt_ids(self, body: dict, chat: bool) -> list[int]:
        tok = self.tokenizer
        if not chat:
            prompt = body["prompt"]
            if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
                if len(prompt) > 1:
                    raise DllmError("send one prompt per request (got a list of strings)")
                prompt = prompt[0]
            return encode_prompts(tok, [prompt], chat=False)[0]
        messages = [{"role": _role(m["role"], i), "content": _text(m["content"], i)}
                    for i, m in enumerate(body["messages"])]
        if getattr(tok, "chat_template", None) is None:
            raise DllmError("this model's tokenizer has no chat template; use /v1/completions")
        for i, m in enumerate(messages):
            check_plain_text(tok, m["content"], f"message {i}")
        if len(messages) == 1 and messages[0]["role"] == "user":
            return encode_prompts(tok, [messages[0]["content"]], chat=True)[0]  # exactly `dllm generate`'s
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return encode_prompts(tok, [text], chat=False)[0]


def _role(role: str, i: int) -> str:
    if role not in ROLES:
        raise DllmError(f"message {i}: role {role!r} is not one of {', '.join(ROLES)}")
    return role


def _text(content: str | list, i: int) -> str:
    """A message's text: its content, or its text parts joined by newlines (as OpenAI's SDKs send content)."""
    if isinstance(content, str):
        return content
    other = next((part["type"] for part in content if part["type"] != "text"), None)
    if other is not None:
        raise DllmError(f"message {i}: content part type {other!r} is not supported; send text parts "
                        f"({{\"type\": \"text\", \"text\": ...}}) or a string")
    if not all(isinstance(part.get("text"), str) for part in content):
        raise DllmError(f"message {i}: a text part needs \"text\": a string")
    return "\n".join(part["text"] for part in content)


def _logprobs(body: dict, chat: bool) -> int | None:
    """The alternatives asked per token (None: no logprobs): `/v1/completions`' `logprobs: k`, or chat's
    `logprobs: true` with `top_logprobs: k` (0 without)."""
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if not chat:
        if top is not None:
            raise DllmError("top_logprobs is a chat field; on /v1/completions send logprobs: k (alternatives per "
                            "token)")
        return check_logprobs(logprobs, name="logprobs")
    if top is not None and not logprobs:
        raise DllmError("top_logprobs needs logprobs: true")
    return check_logprobs(0 if top is None else top, name="top_logprobs") if logprobs else None
