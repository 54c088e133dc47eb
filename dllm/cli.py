"""The `dllm` command: generate, chat, eval, bench, list. Flags use the Python keyword names."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import warnings
from pathlib import Path
from typing import Any

from dllm import cache as caches
from dllm import samplers as samplers_mod

from .core.checks import check_seed
from .core.errors import DllmError, one_line_notice
from .engine.guidance import Guidance
from .engine.options import Settings, settle
from .engine.text import check_plain_text

DEFAULT_MODEL = "tiny-llada"


def _key_values(pairs: list[str], flag: str) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise DllmError(f"{flag} expects KEY=VALUE, got {pair!r}")
        out[key.strip().replace("-", "_")] = value.strip()
    return out


def _json_or_text(value: str) -> Any:
    """A flag's value as JSON where it parses (0.5, true, null), else the text itself."""
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _add_decoding_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="shipped name, random:<preset> or a local directory")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: fp32 on CPU)")
    p.add_argument("--sampler", default=None, help="(default: the model's: its generation_config.json (Dream's "
                   "alg), else its family's (DiffusionGemma: entropy_bound), else low_confidence; see generate "
                   "--explain)")
    p.add_argument("--sampler-arg", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--cache", default=None, help="(default: block on a block-causal model, else none)")
    p.add_argument("--cache-arg", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--gen-length", type=int, default=None,
                   help="answer tokens (default: the model's generation_config.json, else 64; DiffusionGemma: 256)")
    p.add_argument("--block-length", type=int, default=None, help="(default: the model's, else 32)")
    p.add_argument("--steps", type=int, default=None,
                   help="total steps (default: gen-length; DiffusionGemma: max_denoising_steps, 48, per canvas)")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--cfg-scale", type=float, default=0.0,
                   help="classifier-free guidance against the prompt masked (LLaDA's cfg_scale; 0: none)")
    p.add_argument("--logits-eos-inf", action="store_true", help="never propose EOS (LLaDA's logits_eos_inf)")
    p.add_argument("--confidence-eos-eot-inf", action="store_true",
                   help="commit EOS and EoT predictions last (LLaDA's confidence_eos_eot_inf)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true",
                   help="run the model under torch.compile (caches none, prefix, dual, block; compiling takes a while)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap prompts in the chat template (default: when the tokenizer has one)")
    _add_load_flags(p)


def _add_load_flags(p: argparse.ArgumentParser) -> None:
    """The flags `_load` reads besides --model, --device and --dtype."""
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: DLLM_THREADS, else OMP_NUM_THREADS, else 1 for a model under 10M "
                        "parameters and the physical cores for a larger one)")
    p.add_argument("--quantize", default=None, metavar="{int8,int8-dynamic,int4,fp8}",
                   help="quantize the layers' weights while loading (torchao: pip install '.[quant]')")
    p.add_argument("--quantize-head", action="store_true", help="quantize the LM head too")


def _load(args, device: str | None = None):
    """`dllm.load` with the model flags (`device`: this process's GPU, else --device)."""
    import dllm

    return dllm.load(args.model, device=device or args.device, dtype=args.dtype, threads=args.threads,
                     quantize=args.quantize, quantize_head=args.quantize_head)


def _add_prefix_cache_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefix-cache-mb", type=float, default=0,
                   help="keep the keys and values of finished blocks (up to this many MiB, least recently used "
                        "evicted) and reuse them for every request that starts with the same blocks; cache block on "
                        "block-causal (SDAR, LLaDA2, Fast-dLLM v2) and causal-prefix (Nemotron, DiffusionGemma) "
                        "models only")


def _policies(args) -> dict[str, Any]:
    """The flags' sampler, cache and LLaDA options as `settle` keywords, checked before the model loads (a named
    sampler or cache is built once for its parameters); no --sampler or --cache: the model's (`settle`)."""
    sampler_args = _key_values(args.sampler_arg, "--sampler-arg")
    if args.temperature is not None:
        sampler_args["temperature"] = args.temperature
    if args.sampler is not None:
        samplers_mod.SAMPLERS.create(args.sampler, **sampler_args)
    cache_args = _key_values(args.cache_arg, "--cache-arg")
    if args.cache is None and cache_args:
        raise DllmError(f"--cache-arg {args.cache_arg[0]} needs --cache NAME (the default caches take no parameters)")
    if args.cache is not None:
        caches.CACHES.create(args.cache, **cache_args)
    guidance = Guidance(args.cfg_scale, args.logits_eos_inf, args.confidence_eos_eot_inf)
    return dict(sampler=args.sampler, cache=args.cache, sampler_args=sampler_args, cache_args=cache_args,
                **guidance.config())


def _settings(args, model, policies: dict[str, Any] | None = None) -> Settings:
    """The flags over the model's settings (`settle`): what to decode with, and where each value came from."""
    return settle(model, **(policies or _policies(args)), gen_length=args.gen_length, block_length=args.block_length,
                  steps=args.steps)


def _decoding(settings: Settings) -> dict[str, Any]:
    """`settings` as `dllm.generate` keywords."""
    return dict(sampler=settings.sampler, cache=settings.cache, **settings.lengths, **settings.guidance.config())


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


def _stdin_lines():
    """Lines of standard input as they arrive, which must be UTF-8."""
    for number, raw in enumerate(getattr(sys.stdin, "buffer", sys.stdin), 1):
        try:
            yield raw.decode("utf-8") if isinstance(raw, bytes) else raw
        except UnicodeDecodeError:
            raise DllmError(f"line {number} of standard input is not UTF-8 text; convert it, e.g. with "
                            f"iconv -t UTF-8") from None


def _check_writable_file(path: str, flag: str) -> None:
    """Fail before any work if `path` cannot be written (tried, not guessed: root ignores permission bits)."""
    if not path:
        raise DllmError(f"{flag} needs a file name")
    target = Path(path)
    if target.is_dir():
        raise DllmError(f"{flag} {path} is a directory; give a file name")
    if not target.parent.is_dir():
        raise DllmError(f"{flag} {path}: folder {target.parent} does not exist; create it or choose another path")
    try:
        if target.exists():
            open(target, "a").close()  # appends nothing
        else:
            open(target, "x").close()
            target.unlink()
    except OSError as e:
        raise DllmError(f"{flag} {path} is not writable ({e.strerror}); choose another path") from None


def _write_atomically(path: str, text: str) -> None:
    """Write the whole file or nothing (a temporary file renamed into place)."""
    tmp = Path(f"{path}.tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def _progress(args, total: int, desc: str):
    """A tqdm bar on stderr, off with --json and when stderr is not a terminal."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tok", disable=getattr(args, "json", False) or not sys.stderr.isatty(),
                leave=False)


def _generate(args) -> int:
    import dllm

    prompts = args.prompts or [line.rstrip("\r\n") for line in _stdin_lines() if line.strip()]
    if not prompts:
        raise DllmError("no prompt given; pass PROMPT arguments or pipe prompts on stdin, one per line")
    if args.trace is not None:
        _check_writable_file(args.trace, "--trace")
    policies = _policies(args)  # bad flags fail before the model loads
    model, tok = _load(args)
    settings = _settings(args, model, policies)
    if args.explain:
        print(json.dumps(settings.explain()) if args.json else format_explain(settings.explain()))
        return 0
    with _progress(args, len(prompts) * settings.lengths["gen_length"], "generate") as bar:
        out = dllm.generate(model, tok, prompts, **_decoding(settings), seed=args.seed, chat=args.chat,
                            trace=args.trace is not None, compile=args.compile,
                            callback=lambda info: bar.update(info["committed"]))
    if args.trace:
        _write_atomically(args.trace, "".join(json.dumps(record) + "\n" for record in out.trace))
    stats = out.stats.as_dict()
    if args.json:
        print(json.dumps({"outputs": [{"text": t, "token_ids": ids} for t, ids in zip(out.texts, out.token_ids)],
                          "stats": stats, "sampler": out.sampler, "cache": out.cache, "threads": model.threads,
                          **settings.explain()}))
    else:
        for text in out.texts:
            print(text)
        print(f"[{stats['nfe']} forwards, {stats['tpf']:.2f} tokens/forward, {stats['gen_tokens']} tokens, "
              f"{stats['seconds']:.2f} s, {stats['tokens_per_second']:.1f} tokens/s, {model.threads['threads']} "
              f"thread{'s' if model.threads['threads'] > 1 else ''}]", file=sys.stderr)
    return 0


def _chat(args) -> int:
    """A chat on stdin/stdout, each answer printed block by block as it is decoded; each turn decodes the whole
    conversation so far, unless the model was trained on single turns (`multi_turn: false` in its
    generation_config.json) or --no-history is given."""
    import dllm

    if args.chat is False:
        raise DllmError("dllm chat always uses the chat template; drop --no-chat (dllm generate --no-chat sends raw "
                        "text)")
    policies = _policies(args)  # bad flags fail before the model loads
    model, tok = _load(args)
    if getattr(tok, "chat_template", None) is None:
        raise DllmError(f"{args.model} has no chat template; use `dllm generate --no-chat`")
    decoding = _decoding(_settings(args, model, policies))
    history = model.generation_defaults.get("multi_turn", True) if args.history is None else args.history
    if sys.stdin.isatty():
        print(f"chat with {args.model} (empty line to quit)" + ("" if history else
              "; it answers single turns, so each line starts a new conversation (--history keeps them)"),
              file=sys.stderr)
    messages: list[dict[str, str]] = []
    for line in _stdin_lines():
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


def _eval(args) -> int:
    """One configuration, the task's reference solutions (--gold), or a sweep of configurations (--sweep)."""
    from dllm.eval.harness import check_output_dir, count_records

    if args.output:
        check_output_dir(args.output)
    try:
        return _run_eval(args)
    except KeyboardInterrupt:
        kept = f"{count_records(args.output, sweep=bool(args.sweep))} records kept in {args.output}" if args.output \
            else "nothing kept"
        resume = "rerun the same command to resume: " + shlex.join(["dllm", *sys.argv[1:]]) if args.output \
            else "add --output DIR to keep the records and resume"
        print(f"error: interrupted; {kept}; {resume}", file=sys.stderr)
        return 130


def _run_eval(args) -> int:
    from accelerate import PartialState

    from dllm.eval.harness import evaluate
    from dllm.eval.sweep import run_sweep, table
    from dllm.eval.tasks import get_task

    get_task(args.task)
    state = PartialState(cpu=args.device == "cpu")  # data-parallel over CPU processes too (gloo)
    data_args = dict(limit=args.limit, batch_size=args.batch_size, data=args.data, num_fewshot=args.num_fewshot,
                     unsafe_exec=args.unsafe_exec)
    if args.gold:
        if args.sweep:
            raise DllmError("--gold scores the references without a model; drop --sweep")
        summary = evaluate(None, None, args.task, output=args.output, gold=True, **data_args)
    else:
        policies = _policies(args)  # bad flags fail before the model loads
        device = f"cuda:{state.local_process_index}" if args.device == "cuda" else args.device  # one GPU each
        model, tok = _load(args, device)
        settings = _settings(args, model, policies)
        decode_args = dict(**settings.lengths, **settings.guidance.config(), seed=args.seed, chat=args.chat,
                           model_name=args.model, compile=args.compile, recipe=args.recipe, **data_args)
        if args.sweep:
            if not args.output:
                raise DllmError("--sweep needs --output DIR (one folder per point, sweep.json, pareto.png)")
            own = {kind: {k: v for k, v in policy.config().items() if k != "name"}
                   for kind, policy in (("sampler", settings.sampler), ("cache", settings.cache))}
            result = run_sweep(model, tok, args.task, args.sweep, args.output, settings.sampler.name,
                               settings.cache.name, own["sampler"], own["cache"], **decode_args)
            if state.is_main_process:
                if result.get("plot") is None:
                    print("note: pareto.png not drawn: matplotlib is missing; pip install 'dllm-fast[plot]'",
                          file=sys.stderr)
                print(json.dumps(result) if args.json else table(result), end="")
            return 0
        summary = evaluate(model, tok, args.task, settings.sampler, settings.cache, output=args.output,
                           **decode_args)
    if not state.is_main_process:
        return 0
    if args.json:
        print(json.dumps(summary))
    else:
        speed = "" if args.gold else (f" | forwards/example {summary['nfe_mean']:.1f} | tokens/forward "
                                      f"{summary['tpf']:.2f} | {summary['tokens_per_second']:.1f} tokens/s")
        print(f"{summary['task']}: accuracy {summary['accuracy']:.3f} on {summary['n']}{speed}")
        if args.recipe:
            from dllm.eval.recipes import get_recipe
            published = get_recipe(args.recipe).published
            print(f"    recipe {args.recipe}: published {published['metric']} {published['value']} "
                  f"({published['source']})")
        for name, acc in list(summary["accuracy_by_metric"].items())[1:]:
            print(f"    {name}: {acc:.3f}")
        for group, acc in summary["per_group_accuracy"].items():
            print(f"    {group}: {acc:.3f}")
    return 0


def _bench(args) -> int:
    from .engine.bench import bench, format_result

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
    policies = _policies(args)  # bad flags fail before the model loads
    model, tok = _load(args)
    settings = _settings(args, model, policies)
    sampler, cache, lengths = settings.sampler, settings.cache, settings.lengths
    sampler.prepare(tok)  # e.g. AdaBlock's delimiter ids
    sampler.check_gen_length(lengths["gen_length"])
    total = sum(batch_sizes) * (2 + args.repeats) * lengths["gen_length"]  # warm-up, timed runs, forwards timed
    with _progress(args, total, "bench") as bar:
        for batch_size in batch_sizes:  # one load (and one compilation) for every batch size
            result = bench(model, sampler, cache, **lengths, batch_size=batch_size,
                           prompt_length=args.prompt_length, repeats=args.repeats, seed=args.seed,
                           callback=lambda info: bar.update(info["committed"]), compile=args.compile,
                           guidance=settings.guidance)
            print(json.dumps(result) if args.json else format_result(result), end="\n" if args.json else "",
                  flush=True)
    return 0


def _serve_defaults(args) -> dict[str, Any]:
    """The server's decoding defaults from the flags, checked before any model loads (cache None: the model's)."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise DllmError(f"dllm {args.command} needs FastAPI, uvicorn and prometheus_client; "
                        f"pip install 'dllm-fast[serve]' (from a checkout: pip install -e '.[serve]')") from None
    if args.max_batch < 1:
        raise DllmError(f"--max-batch must be at least 1, got {args.max_batch}")
    return {**_policies(args), "gen_length": args.gen_length, "block_length": args.block_length, "steps": args.steps,
            "seed": args.seed}  # the sampler, cache and LLaDA options (checked) and the lengths


def _serve_setup(args):
    """Model, tokenizer and the server's decoding defaults (validated before anything listens)."""
    from .serve.requests import served_defaults

    defaults = _serve_defaults(args)
    model, tok = _load(args)
    return model, tok, served_defaults(model, defaults)


def _check_port(host: str, port: int) -> None:
    """A one-line error now, not after loading the model, for a port out of range or taken."""
    import socket

    if not 0 <= port <= 65535:
        raise DllmError(f"--port must be between 0 and 65535, got {port}")
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        reason = os.strerror(e.errno) if e.errno else str(e)
        raise DllmError(f"cannot listen on {host}:{port} ({reason}); pick another --port or --host") from None


def _serve(args) -> int:
    from .serve import Engine, create_app, server

    if args.replicas is not None:
        from .serve.ray import serve_replicas

        if args.ray_address is None:
            _check_port(args.host, args.port)
        options = dict(_serve_defaults(args), model=args.model, device=args.device, dtype=args.dtype,
                       quantize=args.quantize, quantize_head=args.quantize_head, compile=args.compile,
                       max_batch=args.max_batch, name=args.name, num_replicas=args.replicas,
                       prefix_cache_mb=args.prefix_cache_mb, shutdown_timeout=args.shutdown_timeout)
        return serve_replicas(options, args.ray_address, args.host, args.port, args.threads)
    if args.ray_address is not None:
        raise DllmError("--ray-address needs --replicas N (the replicas to deploy on that cluster)")
    _check_port(args.host, args.port)
    model, tok, defaults = _serve_setup(args)
    engine = Engine(model, tok, args.name or args.model, defaults, args.max_batch, args.compile, args.prefix_cache_mb)
    engine.check_defaults()
    server(create_app(engine), args.host, args.port, args.shutdown_timeout, engine).run()
    return 0


def _bench_serve(args) -> int:
    from .serve.bench import bench_serve, format_bench, plot_bench

    try:
        levels = tuple(int(c) for c in args.concurrency.split(","))
    except ValueError:
        raise DllmError(f"--concurrency takes comma-separated integers, e.g. 1,4,16; got {args.concurrency!r}") \
            from None
    if min(levels) < 1 or args.requests < 1 or args.repeats < 1:
        raise DllmError("--concurrency levels, --requests and --repeats must be at least 1")
    if args.system_prompt_tokens < 0:
        raise DllmError(f"--system-prompt-tokens must be 0 (none) or more, got {args.system_prompt_tokens}")
    if args.plot:
        _check_writable_file(args.plot, "--plot")
    model, tok, defaults = _serve_setup(args)
    mix = {key: _json_or_text(value) for key, value in _key_values(args.mix, "--mix").items()}
    result = bench_serve(model, tok, args.model, defaults, args.max_batch, args.requests, levels, args.compile,
                         prefix_cache_mb=args.prefix_cache_mb, system_prompt_tokens=args.system_prompt_tokens,
                         mix=mix, repeats=args.repeats)
    if args.plot and not plot_bench(result, args.plot):
        print("note: plot not drawn: matplotlib is missing; pip install 'dllm-fast[plot]'", file=sys.stderr)
    print(json.dumps(result) if args.json else format_bench(result), end="\n" if args.json else "")
    return 0


def _quantize(args) -> int:
    """Quantize a model once and save it; `--model DIR` then loads it quantized, as saved."""
    import dllm
    from dllm.models.quantize import check_savable, weight_bytes

    if args.quantize is None:
        raise DllmError("dllm quantize needs --quantize int8, int8-dynamic, int4 or fp8")
    if Path(args.output).is_file() or (Path(args.output).is_dir() and any(Path(args.output).iterdir())):
        raise DllmError(f"--output {args.output} exists and is not an empty directory; choose a new one")
    check_savable(args.quantize, args.device)
    model, tok = _load(args)
    dllm.save_pretrained(model, tok, args.output)
    print(f"{args.output}: {args.model} with {args.quantize} weights, {weight_bytes(model) / 2**20:.1f} MB "
          f"(load it with --model {args.output})")
    return 0


def _list(args) -> int:
    if args.what == "recipes":
        return _list_recipes(args)
    if args.what == "models":
        from .models.loading import describe_models
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


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors as one `error:` line that names the help (exit 2)."""

    def error(self, message: str):
        self.exit(2, f"error: {message}; see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="dllm", description="Fast parallel decoding for diffusion LLMs")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)
    g = sub.add_parser("generate", help="decode prompts (arguments or stdin, one per line)")
    g.add_argument("prompts", nargs="*", metavar="PROMPT")
    _add_decoding_flags(g)
    g.add_argument("--json", action="store_true", help="print outputs and statistics as JSON")
    g.add_argument("--trace", metavar="FILE", help="write a JSON line per step (commits, confidences, gaps)")
    g.add_argument("--explain", action="store_true",
                   help="print every setting, its value and where it came from (flag, the model's "
                        "generation_config.json, its family's authors, dllm), and decode nothing")
    g.set_defaults(run=_generate)
    c = sub.add_parser("chat", help="chat on stdin/stdout, a line per turn")
    _add_decoding_flags(c)
    c.add_argument("--history", action=argparse.BooleanOptionalAction, default=None,
                   help="decode each turn with the conversation so far (default: unless the model's "
                        "generation_config.json says multi_turn: false, as the shipped tiny models do)")
    c.set_defaults(run=_chat)
    e = sub.add_parser("eval", help="score a sampler/cache on a task (JSONL per example + summary.json)")
    e.add_argument("--task", default="synthetic")
    e.add_argument("--recipe", default=None, help="a published table's settings (`dllm list recipes`); the flags "
                   "given win over it, --model names the checkpoint's directory")
    _add_decoding_flags(e)
    e.add_argument("--limit", type=int, default=None, help="first N examples only")
    e.add_argument("--batch-size", type=int, default=16)
    e.add_argument("--output", default=None, help="directory for results.jsonl and summary.json (resumable)")
    e.add_argument("--data", default=None,
                   help="the task's records (.jsonl, .jsonl.gz or .json) instead of the packaged copy")
    e.add_argument("--num-fewshot", type=int, default=None, help="examples before each question (default: the task's)")
    e.add_argument("--gold", action="store_true", help="score the dataset's reference solutions (no model)")
    e.add_argument("--sweep", action="append", default=[], metavar="KEY=VALUE[,...]",
                   help="a configuration to add to a sweep, e.g. sampler=threshold,threshold=0.9 (repeat)")
    e.add_argument("--json", action="store_true", help="print the summary as JSON")
    e.add_argument("--unsafe-exec", action="store_true",
                   help="run generated code without the bubblewrap sandbox (a plain guarded process: contains "
                        "mistakes, not hostile code); only where bwrap cannot be installed")
    e.set_defaults(run=_eval)
    ap.recipe_parser = e  # `main` sets a recipe's settings as its defaults
    b = sub.add_parser("bench", help="time one sampler/cache: ms per forward by kind, tokens/s, rows computed")
    _add_decoding_flags(b)
    b.add_argument("--batch-size", default="1", help="rows decoded together; several, comma-separated (1,8), "
                   "are timed one after another on one loaded model (a JSON line each with --json)")
    b.add_argument("--prompt-length", type=int, default=64, help="random prompt tokens per row")
    b.add_argument("--repeats", type=int, default=3, help="timed runs (the median is reported) after a warm-up")
    b.add_argument("--json", action="store_true")
    b.set_defaults(run=_bench)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server, requests batched between blocks "
                                     "(pip install '.[serve]')")
    _add_decoding_flags(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-batch", type=int, default=8, help="rows decoded together at most")
    s.add_argument("--name", default=None, help="model name clients send and /v1/models lists (default: --model)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for requests in flight before cancelling them")
    _add_prefix_cache_flag(s)
    s.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="N engines behind one port on Ray Serve (pip install '.[ray]'), each with its share of "
                        "the CPUs (--threads T: T each), or one GPU each with --device cuda")
    s.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="with --replicas: deploy on the Ray cluster at ADDR (default: a new local Ray instance)")
    s.set_defaults(run=_serve)
    bs = sub.add_parser("bench-serve", help="served throughput and latency vs client concurrency, against "
                                            "sequential decoding (loopback server)")
    _add_decoding_flags(bs)
    bs.add_argument("--max-batch", type=int, default=8)
    bs.add_argument("--requests", type=int, default=64)
    bs.add_argument("--concurrency", default="1,4,16", help="client counts, comma-separated")
    bs.add_argument("--mix", action="append", default=[], metavar="KEY=VALUE",
                    help="a body field every other request sends (e.g. threshold=0.5: half the requests at "
                         "another threshold); repeat for more")
    bs.add_argument("--repeats", type=int, default=1,
                    help="rounds per concurrency, each a sequential pass then a served one (the median ratio is "
                         "the speedup: steadier on a shared machine)")
    bs.add_argument("--plot", metavar="FILE", help="tokens/s vs concurrency as a PNG (matplotlib)")
    _add_prefix_cache_flag(bs)
    bs.add_argument("--system-prompt-tokens", type=int, default=0,
                    help="give every request one shared system message of about this many tokens")
    bs.add_argument("--json", action="store_true")
    bs.set_defaults(run=_bench_serve)
    q = sub.add_parser("quantize", help="quantize a model's weights once and save them (safetensors)")
    q.add_argument("--model", default=DEFAULT_MODEL, help="shipped name, random:<preset> or a local directory")
    q.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (int4 and fp8 checkpoints: cuda)")
    q.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (what it will load in)")
    _add_load_flags(q)
    q.add_argument("--output", required=True, help="a new directory for the quantized checkpoint")
    q.set_defaults(run=_quantize)
    ls = sub.add_parser("list", help="samplers, caches or models, with parameters and defaults")
    ls.add_argument("what", choices=("samplers", "caches", "models", "recipes"))
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(run=_list)
    return ap


def _with_recipe(parser: argparse.ArgumentParser, argv: list[str] | None, name: str):
    """The eval flags again with recipe `name`'s settings as their defaults: what the command line gives wins."""
    from dllm.eval.recipes import get_recipe

    recipe = get_recipe(name)
    parser.recipe_parser.set_defaults(**recipe.flags())
    args = parser.parse_args(argv)
    if args.model is None:
        raise DllmError(f"recipe {name!r} evaluates {recipe.model}; give its local directory with --model")
    return args


def main(argv: list[str] | None = None) -> int:
    warnings.formatwarning = one_line_notice
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if getattr(args, "recipe", None):
            args = _with_recipe(parser, argv, args.recipe)
        code = args.run(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return code
    except DllmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of our output left (`dllm ... | head`): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
