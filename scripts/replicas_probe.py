"""Where a `dllm serve --replicas N` spends its CPU: starts it (its own session, so that every process of it, Ray's
included, is found), sends a chat load, and prints the requests per second and, per process, its threads and the CPU
seconds it spent under the load (the engine processes, the replicas' HTTP sides, Ray's proxy and the rest), and the
engines' OMP_NUM_THREADS. Extra flags go to `dllm serve`.

    python scripts/replicas_probe.py 1 --cache dual
    python scripts/replicas_probe.py 2 --cache dual
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import psutil

from dllm.serve.client import load


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


def main() -> None:
    replicas, flags = sys.argv[1], sys.argv[2:]
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
        bodies = [{"messages": [{"role": "user", "content": f"copy: abc{i:03d}"}]} for i in range(64)]
        load(url + "/v1/chat/completions", bodies[:4], 4)  # warm-up
        before, began = snapshot(proc.pid), time.monotonic()
        answers = load(url + "/v1/chat/completions", bodies, 16)
        wall, after = time.monotonic() - began, snapshot(proc.pid)
        statuses = sorted({status for status, _, _ in answers["results"]})
        print(f"--replicas {replicas} {' '.join(flags)}: {len(bodies) / wall:.2f} requests/s ({wall:.1f} s, "
              f"statuses {statuses}), load average {os.getloadavg()[0]:.1f}")
        for pid, (name, threads, cpu) in sorted(after.items(), key=lambda p: before.get(p[0], ("", 0, 0))[2] -
                                                 p[1][2]):
            print(f"  {cpu - before.get(pid, ('', 0, 0.0))[2]:6.2f} CPU s  {threads:3} threads  {name}")
        for process in session_processes(proc.pid):
            if "engine_process" in " ".join(process.cmdline()):
                print(f"  engine {process.pid}: OMP_NUM_THREADS={process.environ().get('OMP_NUM_THREADS')}")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
