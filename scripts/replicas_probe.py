"""Where a `dllm serve --replicas N` spends its CPU: starts it (its own session, so that every process of it, Ray's
included, is found), sends a chat load, and prints the requests per second and, per process, its threads and the CPU
seconds it spent under the load (the engine processes, the replicas' HTTP sides, Ray's ingress and the rest), and the
engines' OMP_NUM_THREADS. Extra flags go to `dllm serve`. Given several replica counts and `--rounds R`, it runs
them in turn R times (so that a shared machine's changing speed hits each alike) and prints the medians and the
ratio of the last count to the first, per round and of the medians; `--requests N` (default 64) from 16 clients;
`--latency N` first times N one-token completions sent one after another.

    python scripts/replicas_probe.py 1 --cache dual
    python scripts/replicas_probe.py 1 2 --rounds 5 --requests 256 --cache dual
    python scripts/replicas_probe.py 1 --latency 40 --requests 64 --cache dual
"""
from __future__ import annotations

import argparse
import http.client
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

import psutil

from dllm.serve.client import load, post


def session_processes(session: int) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == session:
                found.append(process)
        except OSError:
            pass
    return found


def snapshot(session: int) -> dict[int, tuple[str, int, float]]:
    """(name, threads, CPU seconds) of each process of `session`."""
    out = {}
    for process in session_processes(session):
        try:
            line = " ".join(process.cmdline())
            name = "engine process" if "engine_process" in line else process.name() if "ray::" in line or \
                "raylet" in line or "gcs" in line else line[:60]
            times = process.cpu_times()
            out[process.pid] = (name, process.num_threads(), times.user + times.system)
        except psutil.Error:
            pass
    return out


ENGINE_NUMBERS = ("dllm_batch_rows_per_step_sum", "dllm_batch_rows_per_step_count", "dllm_engine_busy_seconds_total")


def engine_numbers(session: int) -> dict[int, dict[str, float]]:
    """Each replica's engine counters (ENGINE_NUMBERS), read from the /metrics of the HTTP server it listens on
    itself (Ray Serve's direct ingress, behind HAProxy; none behind Ray's proxy), by the replica's pid."""
    out = {}
    for process in session_processes(session):
        try:
            if "ServeReplica" not in process.name() and "ServeReplica" not in " ".join(process.cmdline()):
                continue
            ports = [c.laddr.port for c in process.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            continue
        for port in ports:
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            except (OSError, ValueError, http.client.HTTPException):  # (its gRPC port)
                continue
            found = dict(re.findall(r"^(dllm_\w+) (\S+)$", text, flags=re.M))
            if "dllm_batch_rows_per_step_count" in found:
                out[process.pid] = {name: float(found.get(name, 0)) for name in ENGINE_NUMBERS}
                break
    return out


def warm_up(url: str, bodies: list[dict], session: int, replicas: int) -> None:
    """Send `bodies` until every replica's engine has decoded some of them: HAProxy takes in a replica a moment after
    the first one answers /ready (behind Ray's proxy, whose replicas are not reached directly, one round and 2 s)."""
    deadline = time.monotonic() + 60
    while True:
        load(url + "/v1/chat/completions", bodies, len(bodies))
        numbers = engine_numbers(session)
        if not numbers:
            time.sleep(2)
            return
        decoded = sum(n["dllm_batch_rows_per_step_count"] > 0 for n in numbers.values())
        if decoded >= replicas:
            return
        assert time.monotonic() < deadline, f"only {decoded} of {replicas} replicas decoded"


def probe(replicas: str, requests: int, flags: list[str], latency: int = 0) -> float:
    """One run: start `dllm serve --replicas N`, time `latency` one-token completions sent one after another, load
    it, print what it spent; returns its requests per second."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "dllm.cli", "serve", "--replicas", replicas, "--port", str(port),
                             *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(url + "/ready", timeout=5)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
                time.sleep(1)
        bodies = [{"messages": [{"role": "user", "content": f"copy: abc{i:03d}"}]} for i in range(requests)]
        warm_up(url, bodies[:4], proc.pid, int(replicas))
        if latency:
            seconds = []
            for _ in range(latency):
                began = time.perf_counter()
                status, answer = post(url + "/v1/completions", {"prompt": "copy: abc", "max_tokens": 1,
                                                                 "block_length": 1})
                seconds.append(time.perf_counter() - began)
                assert status == 200, answer
            print(f"--replicas {replicas} {' '.join(flags)}: a one-token completion (of {latency} one after another) "
                  f"took {1000 * statistics.median(seconds):.1f} ms (median)")
        engines_before = engine_numbers(proc.pid)
        before, began = snapshot(proc.pid), time.monotonic()
        answers = load(url + "/v1/chat/completions", bodies, 16)
        wall, after = time.monotonic() - began, snapshot(proc.pid)
        statuses = sorted({status for status, _, _ in answers["results"]})
        print(f"--replicas {replicas} {' '.join(flags)}: {len(bodies) / wall:.2f} requests/s ({wall:.1f} s, "
              f"statuses {statuses}), load average {os.getloadavg()[0]:.1f}")
        for pid, (name, threads, cpu) in sorted(after.items(), key=lambda p: before.get(p[0], ("", 0, 0))[2] -
                                                 p[1][2]):
            print(f"  {cpu - before.get(pid, ('', 0, 0.0))[2]:6.2f} CPU s  {threads:3} threads  {name}")
        for pid, numbers in engine_numbers(proc.pid).items():
            grown = {k: v - engines_before.get(pid, {}).get(k, 0.0) for k, v in numbers.items()}
            steps = grown["dllm_batch_rows_per_step_count"]
            print(f"  replica {pid}: {steps:.0f} steps of {grown['dllm_batch_rows_per_step_sum'] / max(steps, 1):.2f} "
                  f"rows on average, its engine busy {grown['dllm_engine_busy_seconds_total']:.2f} s of "
                  f"{wall:.2f} s")
        for process in session_processes(proc.pid):
            if "engine_process" in " ".join(process.cmdline()):
                print(f"  engine {process.pid}: OMP_NUM_THREADS={process.environ().get('OMP_NUM_THREADS')}")
        return len(bodies) / wall
    finally:
        proc.send_signal(signal.SIGTERM)  # (to the server alone: one sent to its group would stop Ray's GCS first)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description="Load `dllm serve --replicas N` and show where its CPU goes; other "
                                                 "flags go to dllm serve.")
    parser.add_argument("replicas", nargs="+", type=int, help="replica counts, run in turn")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--latency", type=int, default=0, metavar="N",
                        help="first time N one-token completions sent one after another (the median)")
    args, flags = parser.parse_known_args()
    rates: dict[int, list[float]] = {n: [] for n in args.replicas}
    for _ in range(args.rounds):
        for n in args.replicas:
            rates[n].append(probe(str(n), args.requests, flags, args.latency))
    if args.rounds > 1 or len(rates) > 1:
        medians = {n: statistics.median(r) for n, r in rates.items()}
        print("medians: " + ", ".join(f"--replicas {n} {m:.2f} requests/s ({len(rates[n])} runs)"
                                       for n, m in medians.items()))
        first, last = args.replicas[0], args.replicas[-1]
        if first != last:
            ratios = [a / b for a, b in zip(rates[last], rates[first])]
            print(f"--replicas {last} against {first}: {medians[last] / medians[first]:.2f}x of the medians; per "
                  f"round " + ", ".join(f"{r:.2f}x" for r in ratios))


if __name__ == "__main__":
    main()
