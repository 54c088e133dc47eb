"""The `dllm` command: generate, chat, eval, bench, serve, bench-serve, quantize, list. Flags use the Python
keyword names. `flags` holds what commands share; each command lives in the module of its kind."""
from __future__ import annotations

import argparse
import os
import sys
import warnings

from ..core.errors import DllmError, one_line_notice
from .decode import bench_command, chat_command, generate_command, list_command, quantize_command
from .evaluate import eval_command
from .flags import DEFAULT_MODEL, add_decoding_flags, add_load_flags, add_parallel_flag, add_prefix_cache_flag
from .serving import bench_serve_command, serve_command
from .trace import trace_plot_command


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors as one `error:` line that names the help (exit 2)."""

    def error(self, message: str):
        self.exit(2, f"error: {message}; see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="dllm", description="Fast parallel decoding for diffusion LLMs")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)
    g = sub.add_parser("generate", help="decode prompts (arguments or stdin, one per line)")
    g.add_argument("prompts", nargs="*", metavar="PROMPT")
    add_decoding_flags(g)
    add_parallel_flag(g)
    g.add_argument("--json", action="store_true", help="print outputs and statistics as JSON")
    g.add_argument("--trace", metavar="FILE", help="write a JSON line per step (commits, confidences, gaps) after "
                   "one naming the decode (`dllm trace plot` draws it)")
    g.add_argument("--explain", action="store_true",
                   help="print every setting, its value and where it came from (flag, the model's "
                        "generation_config.json, its family's authors, dllm), and decode nothing")
    g.set_defaults(run=generate_command)
    c = sub.add_parser("chat", help="chat on stdin/stdout, a line per turn")
    add_decoding_flags(c)
    add_parallel_flag(c)
    c.add_argument("--history", action=argparse.BooleanOptionalAction, default=None,
                   help="decode each turn with the conversation so far (default: unless the model's "
                        "generation_config.json says multi_turn: false, as the shipped tiny models do)")
    c.set_defaults(run=chat_command)
    e = sub.add_parser("eval", help="score a sampler/cache on a task (JSONL per example + summary.json)")
    e.add_argument("--task", default="synthetic",
                   help="synthetic, synthetic_lists, gsm8k, math500, humaneval, mbpp, parallelbench (the 17 tasks), "
                        "parallelbench/{waiting_line,text_writing,puzzles} or parallelbench/<group>/<task>")
    e.add_argument("--recipe", default=None, help="a published table's settings (`dllm list recipes`); the flags "
                   "given win over it, --model names the checkpoint's directory")
    add_decoding_flags(e)
    add_parallel_flag(e)
    e.add_argument("--limit", type=int, default=None, help="first N examples only")
    e.add_argument("--batch-size", type=int, default=16)
    e.add_argument("--output", default=None, help="directory for results.jsonl and summary.json (resumable)")
    e.add_argument("--data", default=None,
                   help="the task's records (.jsonl, .jsonl.gz or .json) instead of the packaged copy; parallelbench: "
                        "a checkout of furiosa-ai/ParallelBench (or set DLLM_PARALLELBENCH_DIR)")
    e.add_argument("--num-fewshot", type=int, default=None, help="examples before each question (default: the task's)")
    e.add_argument("--gold", action="store_true", help="score the dataset's reference solutions (no model)")
    e.add_argument("--sweep", action="append", default=[], metavar="KEY=VALUE[,...]",
                   help="a configuration to add to a sweep, e.g. sampler=threshold,threshold=0.9 (repeat)")
    e.add_argument("--json", action="store_true", help="print the summary as JSON")
    e.add_argument("--trace", metavar="FILE", help="write each decoded batch's steps, its rows named by the "
                   "examples' ids (`dllm trace plot` draws them)")
    e.add_argument("--unsafe-exec", action="store_true",
                   help="run generated code without the bubblewrap sandbox (a plain guarded process: contains "
                        "mistakes, not hostile code); only where bwrap cannot be installed")
    e.set_defaults(run=eval_command)
    ap.recipe_parser = e  # `main` sets a recipe's settings as its defaults
    b = sub.add_parser("bench", help="time one sampler/cache: ms per forward by kind, tokens/s, rows computed")
    add_decoding_flags(b)
    b.add_argument("--batch-size", default="1", help="rows decoded together; several, comma-separated (1,8), "
                   "are timed one after another on one loaded model (a JSON line each with --json)")
    b.add_argument("--prompt-length", type=int, default=64, help="random prompt tokens per row")
    b.add_argument("--repeats", type=int, default=3, help="timed runs (the median is reported) after a warm-up")
    add_parallel_flag(b)  # the report adds the collectives and bytes each rank sends per step
    b.add_argument("--json", action="store_true")
    b.set_defaults(run=bench_command)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server, requests batched between blocks "
                                     "(pip install '.[serve]')")
    add_decoding_flags(s)
    add_parallel_flag(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-batch", type=int, default=8, help="rows decoded together at most")
    s.add_argument("--max-waiting", type=int, default=256, metavar="N",
                   help="requests waiting for a batch slot at most; beyond them a request gets 429 with Retry-After")
    s.add_argument("--name", default=None, help="model name clients send and /v1/models lists (default: --model)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for requests in flight before cancelling them")
    s.add_argument("--engine-restart", action="store_true",
                   help="start a new engine process when the engine fails (at most 3 in 5 minutes; the requests in "
                        "flight get 503); without it the server exits non-zero")
    add_prefix_cache_flag(s)
    s.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="N engines behind one port on Ray Serve (pip install '.[ray]'), each with its share of "
                        "the CPUs (--threads T: T each), or one GPU each with --device cuda")
    s.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="with --replicas: deploy on the Ray cluster at ADDR (default: a new local Ray instance)")
    s.set_defaults(run=serve_command)
    bs = sub.add_parser("bench-serve", help="served throughput and latency vs client concurrency, against "
                                            "sequential decoding (loopback server)")
    add_decoding_flags(bs)
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
    add_prefix_cache_flag(bs)
    bs.add_argument("--system-prompt-tokens", type=int, default=0,
                    help="give every request one shared system message of about this many tokens")
    bs.add_argument("--json", action="store_true")
    bs.set_defaults(run=bench_serve_command)
    q = sub.add_parser("quantize", help="quantize a model's weights once and save them (safetensors)")
    q.add_argument("--model", default=DEFAULT_MODEL, help="shipped name, random:<preset> or a local directory")
    q.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (int4 and fp8 checkpoints: cuda)")
    q.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (what it will load in)")
    add_load_flags(q)
    q.add_argument("--output", required=True, help="a new directory for the quantized checkpoint")
    q.set_defaults(run=quantize_command)
    ls = sub.add_parser("list", help="samplers, caches or models, with parameters and defaults")
    ls.add_argument("what", choices=("samplers", "caches", "models", "recipes"))
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(run=list_command)
    tr = sub.add_parser("trace", help="what a --trace file shows").add_subparsers(dest="trace_command", required=True,
                                                                              parser_class=_Parser)
    tp = tr.add_parser("plot", help="the decoding order: each answer position against the step that committed it "
                                    "(and took it back), a column per file (pip install 'dllm-fast[plot]')")
    tp.add_argument("traces", nargs="+", metavar="TRACE", help="files written by generate --trace or eval --trace")
    tp.add_argument("-o", "--output", required=True, help="the figure (.png, .svg, .pdf)")
    tp.add_argument("--rows", type=int, default=4, help="panels per file: its first N rows (default 4)")
    tp.set_defaults(run=trace_plot_command)
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

