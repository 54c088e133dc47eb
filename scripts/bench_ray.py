"""`dllm serve` on Ray Serve replicas against one `dllm serve` process, on this machine (BENCHMARKS.md, "Serving on
Ray"): served throughput of 1 and 2 replicas of one CPU each, the latency Ray adds per request (one replica through
Ray's proxy vs the direct server, one torch thread each, at the same load and one request at a time), and the time
from a command to its first answer (`serve run` of scripts/ray_serve.yaml, `dllm serve --replicas 2`, `dllm serve`).
Every served answer is compared with `dllm.generate` alone. The load average is printed with each row.

    python scripts/bench_ray.py --requests 64 --concurrency 16 --cache dual
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

import dllm
from dllm.eval.synthetic import FAMILIES, make_split
from dllm.serve.client import load, post

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_average() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def measure(name: str, url: str, bodies: list[dict], concurrency: int, want: list[str]) -> dict:
    run = load(url + "/v1/chat/completions", bodies, concurrency)
    ok = [(answer, latency) for status, answer, latency in run["results"] if status == 200]
    latencies = sorted(latency for _, latency in ok) or [float("nan")]
    texts = [answer["choices"][0]["message"]["content"] if status == 200 else None for status, answer, _ in run["results"]]
    row = {"setup": name, "clients": concurrency, "requests": len(bodies), "seconds": run["seconds"],
           "tokens_per_s": sum(a["usage"]["completion_tokens"] for a, _ in ok) / run["seconds"],
           "mean_s": sum(latencies) / len(latencies), "p50_s": latencies[len(latencies) // 2],
           "p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
           "errors": len(bodies) - len(ok), "differ": sum(t is not None and t != w for t, w in zip(texts, want)),
           "load": load_average()}
    print(json.dumps(row), flush=True)
    return row


def wait_answer(url: str, body: dict, proc: subprocess.Popen, began: float) -> float:
    """Seconds from `began` to the first 200 answer of `url` (the process must stay alive)."""
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args} exited with {proc.returncode}")
        try:
            if post(url + "/v1/chat/completions", body, timeout=30)[0] == 200:
                return time.perf_counter() - began
        except OSError:
            pass
        time.sleep(0.2)


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()


def startup(name: str, command: list[str], url: str, body: dict) -> dict:
    began = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        row = {"setup": name, "seconds_to_first_answer": wait_answer(url, body, proc, began), "load": load_average()}
    finally:
        stop(proc)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llada")
    ap.add_argument("--cache", default="dual")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--sequential", type=int, default=16, help="requests sent one at a time (Ray's added latency)")
    ap.add_argument("--max-ongoing-requests", type=int, default=None, help="per replica (default: 2 x max batch)")
    args = ap.parse_args()

    import ray
    from ray import serve

    from dllm.serve.ray import APP_NAME, app

    prompts = [ex.prompt for ex in make_split("test", -(-args.requests // len(FAMILIES)))][:args.requests]
    bodies = [{"messages": [{"role": "user", "content": p}]} for p in prompts]
    model, tok = dllm.load(args.model)
    want = [dllm.generate(model, tok, p, cache=args.cache).texts[0] for p in prompts]
    rows = []

    port = free_port()  # the direct server: one process, one torch thread
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "dllm.cli", "serve", "--model", args.model, "--cache", args.cache,
                             "--max-batch", str(args.max_batch), "--port", str(port)], stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        wait_answer(url, bodies[0], proc, time.perf_counter())
        rows.append(measure("dllm serve", url, bodies, args.concurrency, want))
        rows.append(measure("dllm serve", url, bodies[:args.sequential], 1, want))
    finally:
        stop(proc)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ray.init("local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="warning")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for replicas in (1, 2):
            options = {"model": args.model, "cache": args.cache, "max_batch": args.max_batch,
                       "num_replicas": replicas, "num_cpus": 1, "max_ongoing_requests": args.max_ongoing_requests}
            serve.run(app(options), name=APP_NAME, route_prefix="/")
            load(url + "/v1/chat/completions", bodies[:2 * replicas], 2 * replicas)  # warm-up
            name = f"Ray, {replicas} replica{'s' * (replicas > 1)} x 1 CPU"
            rows.append(measure(name, url, bodies, args.concurrency, want))
            if replicas == 1:
                rows.append(measure(name, url, bodies[:args.sequential], 1, want))
            serve.delete(APP_NAME)
    finally:
        serve.shutdown()
        ray.shutdown()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = yaml.safe_load((ROOT / "scripts" / "ray_serve.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    config["applications"][0]["args"].update(model=args.model, cache=args.cache, max_batch=args.max_batch)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump(config, f)
        f.flush()
        serve_run = str(Path(sys.executable).parent / "serve")
        rows.append(startup("serve run scripts/ray_serve.yaml (starts Ray)", [serve_run, "run", "--address", "local",
                                                                               f.name], url, bodies[0]))
    rows.append(startup("dllm serve --replicas 2", [sys.executable, "-m", "dllm.cli", "serve", "--model", args.model,
                                                    "--replicas", "2", "--port", str(port)], url, bodies[0]))
    rows.append(startup("dllm serve", [sys.executable, "-m", "dllm.cli", "serve", "--model", args.model,
                                       "--port", str(port)], url, bodies[0]))


if __name__ == "__main__":
    main()
