"""The HAProxy of `dllm serve --replicas` on a Ray instance of its own: Ray Serve's HAProxy ingress runs the binary
named by RAY_SERVE_HAPROXY_BINARY_PATH, which is a script (`dllm.serve.ray._haproxy_ingress`) that calls `main`
here: it rewrites the config Ray Serve wrote (`rewrite`), makes HAProxy end with the Ray actor that starts it, and
runs the real HAProxy. The script loads this file by its path, without the dllm package: standard library only."""
from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import sys

MARK = "# rewritten by dllm.serve.haproxy\n"  # (the same file is not rewritten twice)
UNLIMITED = "-any"  # the suffix of a backend's twin that takes every request but a decoding one


def rewrite(text: str, rows: int | None, waiting: int) -> str:
    """Ray Serve's HAProxy config for our instance:
    - HAProxy's own listeners (its Prometheus exporter and stats page), which the config puts on every interface
      (`bind :PORT`, `bind *:PORT`), bind to loopback;
    - where `rows` is given (several replicas), a replica gets at most `rows` decoding requests (POSTs) at once, its
      engine's batch (per-server `maxconn`); the others wait in HAProxy's queue, `waiting` at most (--max-waiting
      times the replicas; beyond: a 429 with Retry-After, as one server's), and go to the first replica with a free
      row. With a queue in each replica, a request waited there while another replica had a free row: leastconn's
      choice between replicas that look equally busy while answers are on their way sends some clients to the full
      one (BENCHMARKS.md, "A batch per replica, and bursts"). Every other request (GET /health, /ready, /metrics,
      /v1/models) goes through a twin of the backend without the limit: it never waits for a row. A lone replica
      keeps its own queue, which refills its batch without a trip through HAProxy."""
    if text.startswith(MARK):
        return text
    text = re.sub(r"^(\s*bind )\*?:(\d+)(?=\s|$)", r"\g<1>127.0.0.1:\2", text, flags=re.M)
    if rows is None:
        return MARK + text
    refusal = json.dumps({"error": {"message": f"{waiting} requests wait for a batch slot already (--max-waiting "
                                               f"of each replica); retry later", "type": "rate_limit_error",
                                    "code": 429}})
    sections, limited = [], []
    for section in re.split(r"^(?=\S)", text, flags=re.M):  # a section starts at a line's first character
        backend = re.match(r"backend (\S+)\n", section)
        if backend and re.search(r"^\s*default-server ", section, flags=re.M):
            name = backend[1]
            limited.append(name)
            sections.append(section.replace(f"backend {name}\n", f"backend {name}{UNLIMITED}\n", 1))
            section = re.sub(r"^(\s*default-server .*)$", rf"\g<1> maxconn {rows}", section, count=1, flags=re.M)
            section = section.replace(f"backend {name}\n", f"backend {name}\n    timeout queue 1h\n"
                                      f"    http-request return status 429 content-type application/json hdr "
                                      f"Retry-After 1 string '{refusal}' if {{ queue ge {waiting} }}\n", 1)
        sections.append(section)
    text = "".join(sections)
    for name in limited:
        text = re.sub(rf"^(\s*)use_backend {re.escape(name)} if (.*)$",
                      rf"\g<1>use_backend {name}{UNLIMITED} if \g<2> !METH_POST\n\g<0>", text, flags=re.M)
    return MARK + text


def main(haproxy: str, rows: int | None, waiting: int) -> None:
    """Rewrite the config file given with -f, then become the real HAProxy (`haproxy`) with the same arguments,
    ending when our parent (Ray's HAProxy manager) ends: HAProxy runs in a session of its own, so a signal to
    `dllm serve`'s process group would leave it listening."""
    args = sys.argv[1:]
    if "-f" in args:
        config = args[args.index("-f") + 1]
        with open(config) as f:
            text = rewrite(f.read(), rows, waiting)
        with open(config, "w") as f:
            f.write(text)
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    os.execv(haproxy, [haproxy, *args])
