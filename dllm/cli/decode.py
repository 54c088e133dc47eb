"""`dllm generate`, `chat`, `bench`, `quantize` and `list`."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from dllm import cache as caches
from dllm import samplers as samplers_mod

from ..core.checks import check_output_dir, check_seed
from ..core.errors import DllmError
from ..engine.text import check_plain_text
from ..engine.trace import trace_lines
from .flags import (
    check_writable_file,
    decoding_keywords,
    fixed_length_only,
    flag_policies,
    load_model,
    progress,
    settings_from,
    stdin_lines,
    write_atomically,
)


def format_explain(explained: dict) -> str:
    """`Settings.explain()` as aligned lines: each setting, its value and where it came from, then every key of
    the model's generation_config.json and what became of it."""
    rows = [(name, repr(s["value"]) if isinstance(s["value"], str) else str(s["value"]), s["from"])
            for name, s in explained["settings"].items()]
    width = max(len(n) + len(v) for n, v, _ in rows) + 3
    lines = [f"{n} = {v}".ljust(width) + f"  ({source})" for n, v, source in rows]
    notes = explained["generation_config.json"]
    lines += ["generation_config.json:" if notes else "generation_config.json: none"]
    lines += [f"  {key}: {note}" for key, note in notes.items()]
    return "\n".join(lines)


def generate_command(args) -> int:
    import dllm

    prompts = args.prompts or [line.rstrip("\r\n") for line in stdin_lines() if line.strip()]
    if not prompts:
        raise DllmError("no prompt given; pass PROMPT arguments or pipe prompts on stdin, one per line")
    if args.trace is not None:
        check_writable_file(args.trace, "--trace")
    policies = flag_policies(args)  # bad flags fail before the model loads
    model, tok = load_model(args)
    settings = settings_from(args, model, policies)
    if args.explain:
        explained = settings.explain()
        explained["settings"]["tensor_parallel"] = {"value": args.tensor_parallel, "from": "caller" if
                                                    args.tensor_parallel > 1 else "dllm default"}
        print(json.dumps(explained) if args.json else format_explain(explained))
        return 0
    gen = settings.lengths["gen_length"]
    with progress(args, len(prompts) * getattr(gen, "initial_gen_length", gen), "generate") as bar:
        out = dllm.generate(model, tok, prompts, **decoding_keywords(settings), seed=args.seed, chat=args.chat,
                            trace=args.trace is not None, compile=args.compile,
                            callback=lambda info: bar.update(info["committed"]))
    if args.trace:
        write_atomically(args.trace, trace_lines(out, model.config.mask_id))
    stats = out.stats.as_dict()
    if args.json:
        print(json.dumps({"outputs": [{"text": t, "token_ids": ids} for t, ids in zip(out.texts, out.token_ids)],
                          "stats": stats, "sampler": out.sampler, "cache": out.cache, "threads": model.threads,
                          **settings.explain()}))
    else:
        for text in out.texts:
            print(text)
        threads = model.threads["threads"]
        ranks = f" per rank, {args.tensor_parallel} ranks" if args.tensor_parallel > 1 else ""
        print(f"[{stats['nfe']} forwards, {stats['tpf']:.2f} tokens/forward, {stats['gen_tokens']} tokens, "
              f"{stats['seconds']:.2f} s, {stats['tokens_per_second']:.1f} tokens/s, {threads} "
              f"thread{'s' if threads > 1 else ''}{ranks}]", file=sys.stderr)
    return 0


def chat_command(args) -> int:
    """A chat on stdin/stdout, each answer printed block by block as it is decoded; each turn decodes the whole
    conversation so far, unless the model was trained on single turns (`multi_turn: false` in its
    generation_config.json) or --no-history is given."""
    import dllm

    if args.chat is False:
        raise DllmError("dllm chat always uses the chat template; drop --no-chat (dllm generate --no-chat sends raw "
                        "text)")
    policies = flag_policies(args)  # bad flags fail before the model loads
    model, tok = load_model(args)
    if getattr(tok, "chat_template", None) is None:
        raise DllmError(f"{args.model} has no chat template; use `dllm generate --no-chat`")
    decoding = decoding_keywords(settings_from(args, model, policies))
    history = model.generation_defaults.get("multi_turn", True) if args.history is None else args.history
    if sys.stdin.isatty():
        print(f"chat with {args.model} (empty line to quit)" + ("" if history else
              "; it answers single turns, so each line starts a new conversation (--history keeps them)"),
              file=sys.stderr)
    messages: list[dict[str, str]] = []
    for line in stdin_lines():
        line = line.strip()
        if not line:
            break
        turn = [*messages, {"role": "user", "content": line}] if history else [{"role": "user", "content": line}]
        try:  # a line the model cannot take is said, and the conversation goes on without it
            check_plain_text(tok, line, "this line")
            text = tok.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
            answer = dllm.stream(model, tok, text, **decoding, seed=args.seed, chat=False, compile=args.compile)
            for delta in answer:  # each block's text once it is decoded
                print(delta, end="", flush=True)
        except DllmError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            continue
        print(flush=True)
        messages = [*turn, {"role": "assistant", "content": answer.generation.texts[0]}]
    return 0


def bench_command(args) -> int:
    from ..engine.bench import bench, format_result

    try:
        batch_sizes = [int(b) for b in args.batch_size.split(",")]
    except ValueError:
        raise DllmError(f"--batch-size takes an integer or comma-separated integers, e.g. 1,8; got "
                        f"{args.batch_size!r}") from None
    for flag, value in (("--batch-size", min(batch_sizes)), ("--prompt-length", args.prompt_length),
                        ("--repeats", args.repeats)):
        if value < 1:
            raise DllmError(f"{flag} must be at least 1, got {value}")
    check_seed(args.seed)
    fixed_length_only(args, "times decoding at one answer length")
    policies = flag_policies(args)  # bad flags fail before the model loads
    model, tok = load_model(args)
    settings = settings_from(args, model, policies)
    sampler, cache, lengths = settings.sampler, settings.cache, settings.lengths
    sampler.prepare(tok)  # e.g. AdaBlock's delimiter ids
    sampler.check_gen_length(lengths["gen_length"])
    total = sum(batch_sizes) * (2 + args.repeats) * lengths["gen_length"]  # warm-up, timed runs, forwards timed
    with progress(args, total, "bench") as bar:
        for batch_size in batch_sizes:  # one load (and one compilation) for every batch size
            result = bench(model, sampler, cache, **lengths, batch_size=batch_size,
                           prompt_length=args.prompt_length, repeats=args.repeats, seed=args.seed,
                           callback=lambda info: bar.update(info["committed"]), compile=args.compile,
                           guidance=settings.guidance)
            print(json.dumps(result) if args.json else format_result(result), end="\n" if args.json else "",
                  flush=True)
    return 0


def quantize_command(args) -> int:
    """Quantize a model once and save it; `--model DIR` then loads it quantized, as saved."""
    import dllm
    from dllm.models.quantize import check_savable, weight_bytes

    if args.quantize is None:
        raise DllmError("dllm quantize needs --quantize int8, int8-dynamic, int4 or fp8")
    if Path(args.output).is_file() or (Path(args.output).is_dir() and any(Path(args.output).iterdir())):
        raise DllmError(f"--output {args.output} exists and is not an empty directory; choose a new one")
    check_output_dir(args.output)
    check_savable(args.quantize, args.device)
    model, tok = load_model(args)
    dllm.save_pretrained(model, tok, args.output)
    print(f"{args.output}: {args.model} with {args.quantize} weights, {weight_bytes(model) / 2**20:.1f} MB "
          f"(load it with --model {args.output})")
    return 0


def list_command(args) -> int:
    if args.what == "recipes":
        return _list_recipes(args)
    if args.what == "models":
        from ..models.loading import describe_models
        entries = describe_models()
    else:
        registry = samplers_mod.SAMPLERS if args.what == "samplers" else caches.CACHES
        entries = [cls.describe() for cls in registry]
    if args.json:
        print(json.dumps(entries, default=str))
        return 0
    for e in entries:
        print(e["name"] + (f" ({e['family']})" if "family" in e else "") + (f": {e['doc']}" if e.get("doc") else ""))
        for p in e.get("params", []):
            default = repr(p["default"]) if isinstance(p["default"], str) else p["default"]
            print(f"    {p['name']} ({p['type']}, default {default}): {p['doc']}")
    return 0


def _list_recipes(args) -> int:
    from dllm.eval.recipes import recipes

    entries = [recipe.describe() for recipe in recipes().values()]
    if args.json:
        print(json.dumps(entries))
        return 0
    for e in entries:
        s, p = e["settings"], e["published"]
        sampler = s["sampler"] + "".join(f",{k}={v}" for k, v in s["sampler_args"].items())
        options = [f"cfg {s['cfg_scale']}"] if s["cfg_scale"] else []
        options += [name for name in ("logits_eos_inf", "confidence_eos_eot_inf") if s[name]]
        print(f"{e['name']}: {e['model']} on {e['task']} ({s['num_fewshot']}-shot{', chat' if s['chat'] else ''}), "
              f"gen {s['gen_length']}, block {s['block_length']}, steps {s['steps']}, {sampler}, cache "
              f"{s['cache']}{''.join(', ' + o for o in options)}: {p['metric']} {p['value']} ({p['source']})")
    return 0
