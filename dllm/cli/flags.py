"""The flags every command shares and what they become: the model load, the sampler/cache checked before it,
the settings `settle` gives, and the small file and stdin helpers."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from dllm import cache as caches
from dllm import samplers as samplers_mod

from ..core.errors import DllmError
from ..engine.guidance import Guidance
from ..engine.options import Settings, settle

DEFAULT_MODEL = "tiny-llada"


def key_values(pairs: list[str], flag: str) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise DllmError(f"{flag} expects KEY=VALUE, got {pair!r}")
        out[key.strip().replace("-", "_")] = value.strip()
    return out


def json_or_text(value: str) -> Any:
    """A flag's value as JSON where it parses (0.5, true, null), else the text itself."""
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def gen_length_flag(value: str) -> int | str:
    """--gen-length: answer tokens, or auto."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a number of tokens or auto, got {value!r}") from None


def add_decoding_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="shipped name, random:<preset> or a local directory")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: fp32 on CPU)")
    p.add_argument("--sampler", default=None, help="(default: the model's: its generation_config.json (Dream's "
                   "alg), else its family's (DiffusionGemma: entropy_bound), else low_confidence; see generate "
                   "--explain)")
    p.add_argument("--sampler-arg", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--cache", default=None, help="(default: block on a block-causal model, else none)")
    p.add_argument("--cache-arg", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--gen-length", type=gen_length_flag, default=None,
                   help="answer tokens (default: the model's generation_config.json, else 64; DiffusionGemma: 256), "
                        "or auto: each answer chooses its length (DAEDAL; sampler threshold unless one is named)")
    p.add_argument("--max-gen-length", type=int, default=None,
                   help="with --gen-length auto: the longest answer (default 2048, or what the context leaves)")
    p.add_argument("--length-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="with --gen-length auto: a DAEDAL parameter (initial_gen_length, eos_threshold, "
                        "expand_threshold, low_threshold, expansion_factor, eos_check_tokens)")
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
    add_load_flags(p)


def add_load_flags(p: argparse.ArgumentParser) -> None:
    """The flags `load_model` reads besides --model, --device and --dtype."""
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: DLLM_THREADS, else OMP_NUM_THREADS, else 1 for a model under 10M "
                        "parameters and the physical cores for a larger one)")
    p.add_argument("--quantize", default=None, metavar="{int8,int8-dynamic,int4,fp8}",
                   help="quantize the layers' weights while loading (torchao: pip install '.[quant]')")
    p.add_argument("--quantize-head", action="store_true", help="quantize the LM head too")


def add_parallel_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the model over N processes, one rank each (heads, feed-forward columns, experts, "
                        "vocabulary), started for you, or the processes of torchrun --nproc-per-node N; gloo on a "
                        "CPU, NCCL on CUDA with rank r on GPU r; --threads T: T threads per rank")


def check_parallel_flags(args) -> None:
    """Refuse, before anything loads, what --tensor-parallel N > 1 cannot run with, and a command that decodes under
    torchrun without it."""
    size = getattr(args, "tensor_parallel", 1)
    if size < 1:
        raise DllmError(f"--tensor-parallel must be at least 1, got {size}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1 and world > 1 and getattr(args, "command", None) in ("generate", "chat", "bench"):
        raise DllmError(f"torchrun started {world} processes, and each would decode alone; add --tensor-parallel "
                        f"{world} to split the model over them")
    if size == 1:
        return
    if args.quantize is not None:
        raise DllmError("--tensor-parallel splits plain weights, and --quantize makes quantized ones; drop one")
    if getattr(args, "gen_length", None) == "auto" or getattr(args, "length_arg", None) or \
            getattr(args, "max_gen_length", None) is not None:
        raise DllmError("--gen-length auto grows each answer's canvas on one process only; give --gen-length N "
                        "with --tensor-parallel")


def load_model(args, device: str | None = None):
    """`dllm.load` with the model flags (`device`: this process's GPU, else --device)."""
    import dllm

    check_parallel_flags(args)
    return dllm.load(args.model, device=device or args.device, dtype=args.dtype, threads=args.threads,
                     quantize=args.quantize, quantize_head=args.quantize_head,
                     tensor_parallel=getattr(args, "tensor_parallel", 1))


def add_prefix_cache_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefix-cache-mb", type=float, default=0,
                   help="keep the keys and values of finished blocks (up to this many MiB, least recently used "
                        "evicted) and reuse them for every request that starts with the same blocks; cache block on "
                        "block-causal (SDAR, LLaDA2, Fast-dLLM v2) and causal-prefix (Nemotron, DiffusionGemma) "
                        "models only")


def flag_policies(args) -> dict[str, Any]:
    """The flags' sampler, cache and LLaDA options as `settle` keywords, checked before the model loads (a named
    sampler or cache is built once for its parameters); no --sampler or --cache: the model's (`settle`)."""
    sampler_args = key_values(args.sampler_arg, "--sampler-arg")
    if args.temperature is not None:
        sampler_args["temperature"] = args.temperature
    if args.sampler is not None:
        samplers_mod.SAMPLERS.create(args.sampler, **sampler_args)
    cache_args = key_values(args.cache_arg, "--cache-arg")
    if args.cache is None and cache_args:
        raise DllmError(f"--cache-arg {args.cache_arg[0]} needs --cache NAME (the default caches take no parameters)")
    if args.cache is not None:
        caches.CACHES.create(args.cache, **cache_args)
    guidance = Guidance(args.cfg_scale, args.logits_eos_inf, args.confidence_eos_eot_inf)
    return dict(sampler=args.sampler, cache=args.cache, sampler_args=sampler_args, cache_args=cache_args,
                **guidance.config())


def length_args(args) -> dict[str, Any] | None:
    """--max-gen-length and --length-arg: gen_length auto's parameters (None: none given)."""
    given = key_values(args.length_arg, "--length-arg")
    if args.max_gen_length is not None:
        given["max_gen_length"] = args.max_gen_length
    return given or None


def fixed_length_only(args, why: str) -> None:
    """Refuse --gen-length auto and its flags for a command that decodes fixed lengths (`why`: the reason)."""
    if args.gen_length == "auto" or length_args(args):
        raise DllmError(f"dllm {args.command} {why}, and --gen-length auto chooses each answer's length while "
                        f"decoding; give --gen-length N")


def settings_from(args, model, policies: dict[str, Any] | None = None) -> Settings:
    """The flags over the model's settings (`settle`): what to decode with, and where each value came from."""
    return settle(model, **(policies or flag_policies(args)), gen_length=args.gen_length,
                  block_length=args.block_length, steps=args.steps, length_args=length_args(args))


def decoding_keywords(settings: Settings) -> dict[str, Any]:
    """`settings` as `dllm.generate` keywords."""
    return dict(sampler=settings.sampler, cache=settings.cache, **settings.lengths, **settings.guidance.config())


def stdin_lines():
    """Lines of standard input as they arrive, which must be UTF-8."""
    for number, raw in enumerate(getattr(sys.stdin, "buffer", sys.stdin), 1):
        try:
            yield raw.decode("utf-8") if isinstance(raw, bytes) else raw
        except UnicodeDecodeError:
            raise DllmError(f"line {number} of standard input is not UTF-8 text; convert it, e.g. with "
                            f"iconv -t UTF-8") from None


def check_writable_file(path: str, flag: str) -> None:
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


def write_atomically(path: str, text: str) -> None:
    """Write the whole file or nothing (a temporary file renamed into place)."""
    tmp = Path(f"{path}.tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def progress(args, total: int, desc: str):
    """A tqdm bar on stderr, off with --json and when stderr is not a terminal."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tok", disable=getattr(args, "json", False) or not sys.stderr.isatty(),
                leave=False)
