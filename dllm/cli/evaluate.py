"""`dllm eval`: one configuration, the reference solutions (--gold) or a sweep, data-parallel with accelerate."""
from __future__ import annotations

import json
import os
import shlex
import sys

from ..core.checks import check_output_dir
from ..core.errors import DllmError
from .flags import flag_policies, load_model, settings_from


def eval_command(args) -> int:
    """One configuration, the task's reference solutions (--gold), or a sweep of configurations (--sweep)."""
    from dllm.eval.harness import count_records

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
    from dllm.eval.tasks import SUITES, get_task

    own_lengths = args.task in SUITES or get_task(args.task).gen_length is not None
    if args.tensor_parallel > 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise DllmError("dllm eval --tensor-parallel starts its ranks itself, and accelerate launch or torchrun "
                        "runs it data-parallel; run it as one plain process")
    state = PartialState(cpu=args.device == "cpu")  # data-parallel over CPU processes too (gloo)
    data_args = dict(limit=args.limit, batch_size=args.batch_size, data=args.data, num_fewshot=args.num_fewshot,
                     unsafe_exec=args.unsafe_exec)
    if args.gold:
        if args.sweep:
            raise DllmError("--gold scores the references without a model; drop --sweep")
        summary = evaluate(None, None, args.task, output=args.output, gold=True, **data_args)
    else:
        policies = flag_policies(args)  # bad flags fail before the model loads
        device = f"cuda:{state.local_process_index}" if args.device == "cuda" else args.device  # one GPU each
        model, tok = load_model(args, device)
        settings = settings_from(args, model, policies)
        lengths = settings.lengths
        if own_lengths and args.gen_length != "auto":  # the task's answer lengths unless the flags set them
            lengths = dict(gen_length=args.gen_length, block_length=args.block_length, steps=args.steps)
        decode_args = dict(**lengths, **settings.guidance.config(), seed=args.seed, chat=args.chat,
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
        if own_lengths and not args.gold:
            speed += f" | tokens/step (answer canvas per forward) {summary['tps_canvas']:.2f}"
        print(f"{summary['task']}: accuracy {summary['accuracy']:.3f} on {summary['n']}{speed}")
        if args.recipe:
            from dllm.eval.recipes import get_recipe
            published = get_recipe(args.recipe).published
            print(f"    recipe {args.recipe}: published {published['metric']} {published['value']} "
                  f"({published['source']})")
        for name, acc in list(summary["accuracy_by_metric"].items())[1:]:
            print(f"    {name}: {'unavailable' if acc is None else f'{acc:.3f}'}")
        if summary["metrics_unavailable"]:
            print(f"    not computed (their tools are not set up): {', '.join(summary['metrics_unavailable'])}")
        for group, acc in summary["per_group_accuracy"].items():
            print(f"    {group}: {acc:.3f}")
    return 0
