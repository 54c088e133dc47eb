"""`dllm serve` on Ray Serve replicas against one `dllm serve` process, on this machine (BENCHMARKS.md, "Serving on
Ray"): served throughput of 1 and 2 replicas of one CPU each (and, for what two processes give without Ray, of two
plain `dllm serve` processes with half the clients each), the latency Ray adds per request (one replica through
Ray's proxy vs the direct server, one torch thread each, at the same load, one request at a time, and the HTTP path
alone: GET /v1/models), the CPU seconds each part spent (the server, Ray's own processes, the client), and the time
from a command to its first answer (`serve run` of scripts/ray_serve.yaml, `dllm serve --replicas 2`, `dllm serve`).

The servers run side by side (the two direct ones, and two Ray applications, /one and /two, on one local Ray
instance), and each round loads each of them in turn, in a rotated order: on a shared machine whose load drifts,
every setup meets the same drift, and the summary takes each setup's median over the rounds. Every served answer
is compared with `dllm.generate` alone. The load average is printed with each row.

    python scripts/bench_ray.py --requests 64 --concurrency 16 --cache dual --rounds 5
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

DIRECT = "dllm serve"
TWO_DIRECT = "2 x dllm serve, no Ray"  # half the clients and requests each
RAY = {1: "Ray, 1 replica x 1 CPU", 2: "Ray, 2 replicas x 1 CPU"}
ROUTE = {RAY[1]: "one", RAY[2]: "two"}  # their Ray applications


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_average() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def cpu_seconds(direct: list[int]) -> dict[str, float]:
    """CPU seconds (user + system) so far, by role, of this process's descendants (Linux /proc): the direct servers
    (pids `direct`: "direct", "direct 2"), the replicas of each Ray application ("one", "two"), and Ray's own processes (HTTP proxy,
    controller, GCS, raylet, agents); "client" is this process (the client threads and Ray's driver)."""
    parent, role, ticks = {}, {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:  # ended meanwhile
            continue
        pid, fields = int(entry.name), stat[stat.rindex(")") + 2:].split()
        parent[pid], ticks[pid] = int(fields[1]), int(fields[11]) + int(fields[12])
        role[pid] = ("direct", "direct 2")[direct.index(pid)] if pid in direct else command.split(":")[3] \
            if command.startswith("ray::ServeReplica:") else "ray"
    hz, me, totals = os.sysconf("SC_CLK_TCK"), os.getpid(), {}
    for pid in ticks:
        ancestor = parent.get(pid)
        while ancestor not in (None, 0, me):
            ancestor = parent.get(ancestor)
        if ancestor == me:
            totals[role[pid]] = totals.get(role[pid], 0.0) + ticks[pid] / hz
    times = os.times()
    return {**totals, "client": times.user + times.system}


def measure(name: str, urls: list[str], bodies: list[dict], concurrency: int, want: list[str], direct: list[int]
            ) -> dict:
    """One load run (of two servers at once, each with every other body and half the clients, where `urls` has
    two); CPU seconds spent meanwhile by the server (the direct ones or the application's replicas), by Ray's own
    processes and by the client, and how busy the server's cores were (CPU s / wall s / cores)."""
    servers = {DIRECT: ["direct"], TWO_DIRECT: ["direct", "direct 2"]}.get(name, [ROUTE.get(name)])
    cores = 1 if name in (DIRECT, RAY[1]) else 2
    before = cpu_seconds(direct)
    run = load_each([url + "/v1/chat/completions" for url in urls], bodies, concurrency)
    after = cpu_seconds(direct)
    spent = {k: after[k] - before.get(k, 0.0) for k in after}
    server_cpu = sum(spent.get(server, 0.0) for server in servers)
    ok = [(answer, latency) for status, answer, latency in run["results"] if status == 200]
    latencies = sorted(latency for _, latency in ok) or [float("nan")]
    texts = [answer["choices"][0]["message"]["content"] if status == 200 else None for status, answer, _ in run["results"]]
    row = {"setup": name, "clients": concurrency, "requests": len(bodies), "seconds": run["seconds"],
           "tokens_per_s": sum(a["usage"]["completion_tokens"] for a, _ in ok) / run["seconds"],
           "mean_s": sum(latencies) / len(latencies), "p50_s": latencies[len(latencies) // 2],
           "p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
           "server_cpu_s": server_cpu, "ray_cpu_s": spent.get("ray", 0.0),
           "client_cpu_s": spent["client"], "server_busy": server_cpu / run["seconds"] / cores,
           "errors": len(bodies) - len(ok), "differ": sum(t is not None and t != w for t, w in zip(texts, want)),
           "load": load_average()}
    print(json.dumps(row), flush=True)
    return row


def load_each(urls: list[str], bodies: list[dict], concurrency: int) -> dict:
    """`load` of one server, or of several at once, server i taking bodies i, i + n, ... with its share of the
    clients; the answers in the order of `bodies`."""
    if len(urls) == 1:
        return load(urls[0], bodies, concurrency)
    from concurrent.futures import ThreadPoolExecutor

    n = len(urls)
    began = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        runs = list(pool.map(lambda i: load(urls[i], bodies[i::n], concurrency // n), range(n)))
    results = [None] * len(bodies)
    for i, run in enumerate(runs):
        results[i::n] = run["results"]
    return {"results": results, "seconds": time.perf_counter() - began}


def round_trip(name: str, url: str, count: int) -> dict:
    """The HTTP path alone: `count` GET /v1/models one after another (no decoding), median and p90 milliseconds."""
    import urllib.request

    times = []
    for _ in range(count):
        began = time.perf_counter()
        with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
            r.read()
        times.append(1000 * (time.perf_counter() - began))
    times.sort()
    row = {"setup": name, "round_trips": count, "median_ms": times[count // 2], "p90_ms": times[int(0.9 * count)],
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


def summary(rows: list[dict], trips: list[dict]) -> None:
    """Each setup's median over the rounds, and the ratios the issue asks for."""
    import statistics

    trip = {name: statistics.median(t["median_ms"] for t in trips if t["setup"] == name) for name in (DIRECT, RAY[1])}

    median = {}
    for (name, clients) in dict.fromkeys((r["setup"], r["clients"]) for r in rows):
        mine = [r for r in rows if (r["setup"], r["clients"]) == (name, clients)]
        median[name, clients] = {k: statistics.median(r[k] for r in mine)
                                 for k in ("tokens_per_s", "mean_s", "p50_s", "p99_s", "server_cpu_s", "ray_cpu_s",
                                           "client_cpu_s", "server_busy")}
        print(json.dumps({"median_of": len(mine), "setup": name, "clients": clients, **median[name, clients]}))
    loaded = max(r["clients"] for r in rows)
    one, two, direct = median[RAY[1], loaded], median[RAY[2], loaded], median[DIRECT, loaded]
    print(json.dumps({"two_over_one_replica": two["tokens_per_s"] / one["tokens_per_s"],
                      "two_direct_over_one": median[TWO_DIRECT, loaded]["tokens_per_s"] / direct["tokens_per_s"],
                      "ray_added_mean_s_loaded": one["mean_s"] - direct["mean_s"],
                      "ray_added_mean_s_alone": median[RAY[1], 1]["mean_s"] - median[DIRECT, 1]["mean_s"],
                      "round_trip_ms": trip, "ray_added_round_trip_ms": trip[RAY[1]] - trip[DIRECT]}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llada")
    ap.add_argument("--cache", default="dual")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--sequential", type=int, default=16, help="requests sent one at a time (Ray's added latency)")
    ap.add_argument("--round-trips", type=int, default=200, help="GET /v1/models one at a time (the HTTP path)")
    ap.add_argument("--rounds", type=int, default=5, help="each setup loaded once per round, in a rotated order")
    ap.add_argument("--max-ongoing-requests", type=int, default=None, help="per replica (default: 2 x max batch)")
    ap.add_argument("--no-startup", action="store_true", help="skip the start-up times")
    args = ap.parse_args()

    import ray
    from ray import serve

    from dllm.serve.ray import app

    prompts = [ex.prompt for ex in make_split("test", -(-args.requests // len(FAMILIES)))][:args.requests]
    bodies = [{"messages": [{"role": "user", "content": p}]} for p in prompts]
    model, tok = dllm.load(args.model)
    want = [dllm.generate(model, tok, p, cache=args.cache).texts[0] for p in prompts]
    rows, trips = [], []

    urls, procs = {}, []
    for _ in range(2):  # the direct servers: a process each, one torch thread each
        port = free_port()
        urls.setdefault(DIRECT, []).append(f"http://127.0.0.1:{port}")
        procs.append(subprocess.Popen([sys.executable, "-m", "dllm.cli", "serve", "--model", args.model, "--cache",
                                       args.cache, "--max-batch", str(args.max_batch), "--port", str(port)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"}))
    urls[TWO_DIRECT], urls[DIRECT] = urls[DIRECT], urls[DIRECT][:1]
    pids = [proc.pid for proc in procs]
    port = free_port()
    # 3 logical CPUs: the three replicas (1 + 2) deployed side by side; at most two of them busy at a time
    ray.init("local", num_cpus=3, include_dashboard=False, log_to_driver=False, logging_level="warning")
    try:
        for url, proc in zip(urls[TWO_DIRECT], procs):
            wait_answer(url, bodies[0], proc, time.perf_counter())
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for replicas in (1, 2):
            options = {"model": args.model, "cache": args.cache, "max_batch": args.max_batch,
                       "num_replicas": replicas, "num_cpus": 1, "max_ongoing_requests": args.max_ongoing_requests}
            route = ROUTE[RAY[replicas]]
            serve.run(app(options), name=route, route_prefix=f"/{route}")
            urls[RAY[replicas]] = [f"http://127.0.0.1:{port}/{route}"]
            load(urls[RAY[replicas]][0] + "/v1/chat/completions", bodies[:4], 4)  # warm-up
        setups = list(urls)
        for turn in range(args.rounds):
            for name in setups[turn % len(setups):] + setups[:turn % len(setups)]:
                rows.append(measure(name, urls[name], bodies, args.concurrency, want, pids))
                if name in (DIRECT, RAY[1]):
                    rows.append(measure(name, urls[name], bodies[:args.sequential], 1, want, pids))
                    trips.append(round_trip(name, urls[name][0], args.round_trips))
    finally:
        for proc in procs:
            stop(proc)
        serve.shutdown()
        ray.shutdown()
    summary(rows, trips)
    if args.no_startup:
        return

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = yaml.safe_load((ROOT / "scripts" / "ray_serve.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    config["applications"][0]["args"].update(model=args.model, cache=args.cache, max_batch=args.max_batch)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump(config, f)
        f.flush()
        serve_run = str(Path(sys.executable).parent / "serve")
        startup("serve run scripts/ray_serve.yaml (starts Ray)", [serve_run, "run", "--address", "local", f.name],
                url, bodies[0])
    startup("dllm serve --replicas 2", [sys.executable, "-m", "dllm.cli", "serve", "--model", args.model,
                                        "--replicas", "2", "--port", str(port)], url, bodies[0])
    startup("dllm serve", [sys.executable, "-m", "dllm.cli", "serve", "--model", args.model, "--port", str(port)],
            url, bodies[0])


if __name__ == "__main__":
    main()
