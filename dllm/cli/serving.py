"""`dllm serve` (an HTTP process and its engine process, or replicas on Ray Serve) and `dllm bench-serve`."""
from __future__ import annotations

import json
import os
import sys
from typing import Any

from ..core.errors import DllmError
from .flags import (
    check_parallel_flags,
    check_writable_file,
    fixed_length_only,
    flag_policies,
    json_or_text,
    key_values,
    load_model,
)


def serve_defaults(args) -> dict[str, Any]:
    """The server's decoding defaults from the flags, checked before any model loads (cache None: the model's)."""
    try:
        import fastapi  # noqa: F401
        import msgspec  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
        import zmq  # noqa: F401
    except ImportError:
        raise DllmError(f"dllm {args.command} needs FastAPI, uvicorn, prometheus_client, pyzmq and msgspec; "
                        f"pip install 'dllm-fast[serve]' (from a checkout: pip install -e '.[serve]')") from None
    if args.max_batch < 1:
        raise DllmError(f"--max-batch must be at least 1, got {args.max_batch}")
    if getattr(args, "max_waiting", 0) < 0:
        raise DllmError(f"--max-waiting must be 0 or more, got {args.max_waiting}")
    fixed_length_only(args, "batches requests between blocks at fixed answer lengths")
    check_parallel_flags(args)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise DllmError(f"dllm {args.command} starts its engine's tensor-parallel ranks itself (--tensor-parallel N); "
                        f"run it as one process, not under torchrun")
    return {**flag_policies(args), "gen_length": args.gen_length, "block_length": args.block_length,
            "steps": args.steps, "seed": args.seed}  # the sampler, cache and LLaDA options (checked) and the lengths


def serve_setup(args, weights: bool = True):
    """Model, tokenizer and the server's decoding defaults (validated before anything listens); `weights=False`:
    the model on the meta device, for the HTTP process's checks."""
    from ..serve.requests import served_defaults

    defaults = serve_defaults(args)
    model, tok = engine_spec(args).load(weights) if not weights else load_model(args)
    return model, tok, served_defaults(model, defaults)


def engine_spec(args):
    """The engine process the flags describe."""
    from ..serve.engine_process import EngineSpec

    return EngineSpec(model=args.model, device=args.device, dtype=args.dtype, threads=args.threads,
                      quantize=args.quantize, quantize_head=args.quantize_head, max_batch=args.max_batch,
                      compile=args.compile, prefix_cache_mb=args.prefix_cache_mb,
                      tensor_parallel=getattr(args, "tensor_parallel", 1))


def _check_port(host: str, port: int) -> None:
    """A one-line error now, not after loading the model, for a port out of range or taken."""
    import socket

    if not 0 <= port <= 65535:
        raise DllmError(f"--port must be between 0 and 65535, got {port}")
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        if e.errno is None or e.errno >= 0:
            reason = os.strerror(e.errno) if e.errno else str(e)
            raise DllmError(f"cannot listen on {host}:{port} ({reason}); pick another --port or --host") from None
        # getaddrinfo's (negative) error: not an address, nor a name this machine resolves ("Unknown error -2")
        raise DllmError(f"--host {host!r} is not a valid address or a name this machine resolves; give an IP "
                        f"address of this machine (127.0.0.1, 0.0.0.0) or its name") from None


def serve_command(args) -> int:
    from ..serve import EngineClient, create_app, server
    from ..serve.requests import RequestReader

    if args.replicas is not None:
        from ..serve.ray import serve_replicas

        if args.tensor_parallel > 1:
            raise DllmError("--replicas runs one engine per Ray worker, and a tensor-parallel engine starts its ranks "
                            "as its own children; drop --replicas or --tensor-parallel")

        if args.engine_restart:
            raise DllmError("--engine-restart: Ray replaces a replica whose engine failed; drop --engine-restart")
        if args.ray_address is None:
            _check_port(args.host, args.port)
        options = dict(serve_defaults(args), model=args.model, device=args.device, dtype=args.dtype,
                       quantize=args.quantize, quantize_head=args.quantize_head, compile=args.compile,
                       max_batch=args.max_batch, name=args.name, num_replicas=args.replicas,
                       prefix_cache_mb=args.prefix_cache_mb, shutdown_timeout=args.shutdown_timeout,
                       max_waiting=args.max_waiting)
        return serve_replicas(options, args.ray_address, args.host, args.port, args.threads)
    if args.ray_address is not None:
        raise DllmError("--ray-address needs --replicas N (the replicas to deploy on that cluster)")
    _check_port(args.host, args.port)
    model, tok, defaults = serve_setup(args, weights=False)  # the weights load in the engine process
    engine = EngineClient(RequestReader(model, tok, args.name or args.model, defaults, args.compile),
                          engine_spec(args), restart=args.engine_restart, max_waiting=args.max_waiting)
    engine.check_defaults()
    engine.start()
    server(create_app(engine), args.host, args.port, args.shutdown_timeout, engine).run()
    if engine.failed:  # the last line says why (after uvicorn's own)
        print(f"dllm: {engine.failure}", file=sys.stderr, flush=True)
        return 1
    return 0


def bench_serve_command(args) -> int:
    from ..serve.bench import bench_serve, format_bench, plot_bench

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
        check_writable_file(args.plot, "--plot")
    model, tok, defaults = serve_setup(args)
    mix = {key: json_or_text(value) for key, value in key_values(args.mix, "--mix").items()}
    result = bench_serve(model, tok, engine_spec(args), defaults, args.requests, levels,
                         system_prompt_tokens=args.system_prompt_tokens, mix=mix, repeats=args.repeats)
    if args.plot and not plot_bench(result, args.plot):
        print("note: plot not drawn: matplotlib is missing; pip install 'dllm-fast[plot]'", file=sys.stderr)
    print(json.dumps(result) if args.json else format_bench(result), end="\n" if args.json else "")
    return 0
