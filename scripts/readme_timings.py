"""Wall time of the README's CPU examples, each run as its own process the way a reader types it.

    python scripts/readme_timings.py --env DLLM_THREADS=2 --repeats 2    # e.g. torch's old default on 2 cores
    python scripts/readme_timings.py                                      # the default thread count

Runs every `dllm generate`/`chat`/`list`/`bench`/`eval` line of README.md's shell blocks that needs no real
checkpoint, no server and no GPU, and its first Python block, in a scratch folder; prints a Markdown row per
example with the median wall seconds and the 1-minute load average read before its first run (the machine may be
shared). `--env` sets variables for the runs (repeatable); OMP_NUM_THREADS and DLLM_THREADS are cleared first.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = re.compile(r"(^|\| )dllm (generate|chat|list|bench|eval)\b")
SKIP = ("/path/", "--device cuda", "accelerate ", "--gold")  # real checkpoints, GPUs, the reference solutions


def examples() -> list[tuple[str, str]]:
    """(label, shell command) of each README example that runs on a CPU with the shipped models."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(\w*)\n(.*?)```", readme, re.S)
    out = []
    for lang, body in blocks:
        if lang != "bash":
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+# .*$", "", line.split(" && ")[-1].strip())
            if RUN.search(line) and not any(s in line for s in SKIP):
                out.append((re.sub(r"\s+", " ", line), line))
    code = next(body for lang, body in blocks if lang == "python")
    out.append(("README's first Python block", f"{sys.executable} -c {_quote(code)}"))
    return out


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--only", default="", help="run only the examples whose command matches this regex")
    ap.add_argument("--timeout", type=float, default=600, help="seconds an example may take (then: > TIMEOUT)")
    args = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "DLLM_THREADS")}
    env.update(pair.split("=", 1) for pair in args.env)
    print(f"| example | seconds (median of {args.repeats}) | load average before |\n|---|---|---|")
    for label, command in examples():
        if not re.search(args.only, command):
            continue
        load, seconds = os.getloadavg()[0], []
        for _ in range(args.repeats):
            seconds.append(timed(command, env, args.timeout, label))
        median = statistics.median(seconds)
        print(f"| `{label}` | {'> %g' % args.timeout if median == float('inf') else f'{median:.2f}'} | {load:.2f} |",
              flush=True)


def timed(command: str, env: dict, timeout: float, label: str) -> float:
    """Wall seconds of one run in a fresh folder (an --output run never resumes); inf past `timeout`."""
    with tempfile.TemporaryDirectory() as scratch:
        start = time.perf_counter()
        process = subprocess.Popen(["bash", "-c", command], cwd=scratch, env=env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            _, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            return float("inf")
        if process.returncode:
            sys.exit(f"{label} failed ({process.returncode}): {err[-500:]}")
        return time.perf_counter() - start


if __name__ == "__main__":
    main()
