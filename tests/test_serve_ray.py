"""`dllm serve` on Ray Serve replicas: one local Ray instance (2 CPUs) for the module, two replicas of one CPU each
behind Ray's HTTP proxy. Answers equal `dllm.generate` alone, streaming per block, a disconnect stops its row, one-line
400s, metrics of every replica in Ray's export, a killed replica costs only its own requests and is replaced, a
deleted application lets its requests finish, and `dllm serve --replicas --ray-address` joins a running cluster."""
import http.client
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
ray = pytest.importorskip("ray", reason="Ray Serve is not installed: pip install -e '.[ray]'")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install -e '.[ray]'")

import dllm  # noqa: E402
from conftest import ROOT  # noqa: E402
from dllm.cli import main  # noqa: E402
from dllm.eval.synthetic import make_split  # noqa: E402
from dllm.serve.client import post  # noqa: E402
from dllm.serve.ray import APP_NAME, app, local_cpus  # noqa: E402
from test_serve import chat, check_stream_by_block, sse, text_of  # noqa: E402

WAIT = 120  # seconds any one wait may take before the test fails (nothing hangs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, url: str, metrics_url: str):
        self.url, self.metrics_url = url, metrics_url

    def exported(self, metric: str, **labels) -> dict[str, float]:
        """Ray's export of `metric` (labels matched), summed per replica."""
        with urllib.request.urlopen(self.metrics_url, timeout=30) as r:
            text = r.read().decode()
        per_replica: dict[str, float] = {}
        for line in text.splitlines():
            if not line.startswith(metric + "{"):
                continue
            tags = dict(re.findall(r'(\w+)="([^"]*)"', line[:line.rindex("}")]))
            if all(tags.get(k) == v for k, v in labels.items()):
                per_replica[tags["replica"]] = per_replica.get(tags["replica"], 0.0) + float(line.split()[-1])
        return per_replica

    def first_blocks(self) -> dict[str, float]:
        """Requests that have decoded their first block, per replica (a counter: Ray keeps it, unlike a gauge that
        a busy worker reported late)."""
        return self.exported("ray_dllm_first_block_seconds_count")

    def wait_first_blocks(self, before: dict[str, float], replicas: int = 1) -> None:
        """Until `replicas` replicas each decoded a first block more than in `before`: requests are decoding."""
        self.wait_exported("ray_dllm_first_block_seconds_count",
                           lambda v: sum(v[r] > before.get(r, 0) for r in v) >= replicas)

    def wait_exported(self, metric: str, until, **labels) -> dict[str, float]:
        """Poll Ray's export (reported every second here) until `until(per_replica)` holds."""
        deadline = time.monotonic() + WAIT
        while not until(values := self.exported(metric, **labels)):
            assert time.monotonic() < deadline, f"{metric} {labels}: {values}"
            time.sleep(0.5)
        return values


@pytest.fixture(scope="module")
def cluster():
    metrics_port, http_port = free_port(), free_port()
    try:
        ray.init("local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="warning",
                 _metrics_export_port=metrics_port, _system_config={"metrics_report_interval_ms": 1000})
    except Exception as e:  # e.g. no shared memory or sockets in a sandbox
        pytest.skip(f"Ray cannot start here: {type(e).__name__}: {e}")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        # 4 requests at most per replica: 8 at once split 4 + 4, whatever Ray's router knows of the replicas' queues
        serve.run(app({"num_replicas": 2, "num_cpus": 1, "max_batch": 8, "max_ongoing_requests": 4}), name=APP_NAME,
                  route_prefix="/")
        yield Cluster(f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def tiny():
    return dllm.load("tiny-llada")


def post_all(url: str, bodies: list) -> list[tuple[int, dict | str]]:
    """All bodies at once, a client thread each."""
    results: list = [None] * len(bodies)

    def one(i):
        results[i] = post(url, bodies[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=WAIT)
    assert not any(t.is_alive() for t in threads), "a request hung"
    return results


def test_two_replicas_answer_32_concurrent_requests_as_generate_alone(cluster, tiny):
    """The issue's test: 32 requests at once over two replicas, each answer token for token its solo `generate`;
    both replicas took a share (Ray's metrics export, tagged by replica, counts every one)."""
    model, tok = tiny
    prompts = [ex.prompt for ex in make_split("test", 7)][:32]
    solo = [dllm.generate(model, tok, p, cache="dual") for p in prompts]
    results = post_all(cluster.url + "/v1/chat/completions", [chat(p, cache="dual") for p in prompts])
    assert [status for status, _ in results] == [200] * 32, results
    assert [text_of(a) for _, a in results] == [g.texts[0] for g in solo]
    assert [a["usage"]["completion_tokens"] for _, a in results] == [len(g.token_ids[0]) for g in solo]
    served = cluster.wait_exported("ray_dllm_requests_total", lambda v: sum(v.values()) >= 32, endpoint="chat",
                                   outcome="ok")
    assert len(served) == 2 and min(served.values()) > 0, served


def test_stream_through_ray_sends_each_block_then_reason_and_done(cluster, tiny):
    check_stream_by_block(cluster.url, *tiny)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_that_disconnects_through_ray_stops_its_row(cluster, stream):
    """A long answer (7 blocks, one token per step) whose client leaves while it decodes: Ray's proxy cancels the
    replica's handler, and the row stops before its answer is complete (counted as cancelled)."""
    before = sum(cluster.exported("ray_dllm_requests_total", outcome="cancelled").values())
    started = cluster.first_blocks()
    host, port = cluster.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=WAIT)
    body = chat("copy: abcd", gen_length=224, block_length=32, ignore_eos=True, stream=stream)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    cluster.wait_first_blocks(started)  # 6 blocks to go
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    cluster.wait_exported("ray_dllm_requests_total", lambda v: sum(v.values()) == before + 1, outcome="cancelled")


@pytest.mark.parametrize("body,message", [
    ({"prompt": "copy: ab", "sampler": "thresh"}, "unknown sampler 'thresh'"),
    ({"prompt": "copy: " + "a" * 400}, "exceeds the model's context"),
    ({"prompt": "copy: ab", "seed": "x"}, "seed must be an integer"),
    (b"{oops", "not valid JSON"),
])
def test_bad_requests_through_ray_get_400_with_the_cli_message(cluster, body, message):
    status, answer = post(cluster.url + "/v1/completions", body)
    assert status == 400 and message in answer["error"]["message"] and "\n" not in answer["error"]["message"]


def test_a_body_over_4_mib_gets_413_through_ray(cluster):
    status, answer = post(cluster.url + "/v1/completions", {"prompt": "a" * (5 << 20)})
    assert status == 413 and "larger than 4 MiB" in answer["error"]["message"]


def test_models_and_health_through_ray(cluster):
    with urllib.request.urlopen(cluster.url + "/v1/models") as r:
        assert json.loads(r.read())["data"][0]["id"] == "tiny-llada"
    with urllib.request.urlopen(cluster.url + "/health") as r:
        assert json.loads(r.read())["status"] == "ok"


def test_the_shipped_serve_config_is_valid_and_builds():
    """scripts/ray_serve.yaml passes Ray's own schema for `serve deploy`, and its args build the application."""
    import yaml
    from ray.serve.deployment import Application
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(yaml.safe_load((ROOT / "scripts" / "ray_serve.yaml").read_text()))
    (application,) = config.applications
    assert application.import_path == "dllm.serve.ray:app"
    assert isinstance(app(application.args), Application)


def test_the_readme_serve_run_line_builds():
    """README's `serve run dllm.serve.ray:app key=value ...`: Ray hands the builder strings, which it takes."""
    from ray.serve.deployment import Application

    from dllm.serve.ray import ReplicaOptions

    line = re.search(r"^serve run dllm\.serve\.ray:app (.*)$", (ROOT / "README.md").read_text(), re.M).group(1)
    args = dict(pair.split("=", 1) for pair in line.split())
    assert isinstance(app(args), Application)
    assert ReplicaOptions(**args).num_replicas == int(args["num_replicas"])


def test_ray_is_imported_only_when_used():
    """`import dllm`, the command line and even dllm.serve.ray leave Ray unimported until a deployment is built."""
    code = "import sys, dllm, dllm.cli, dllm.serve, dllm.serve.ray; print('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_autoscaling_instead_of_a_replica_count_builds():
    from ray.serve.deployment import Application

    scaling = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8}
    assert isinstance(app({"autoscaling_config": scaling}), Application)


@pytest.mark.parametrize("args,message", [
    ({"sampler": "thresh"}, "unknown sampler 'thresh'"),
    ({"device": "cuda:1"}, "each replica gets its own GPU"),
    ({"num_replicas": 0}, "num_replicas (--replicas) must be at least 1"),
])
def test_the_builder_refuses_bad_options_before_deploying(args, message):
    with pytest.raises(dllm.DllmError, match=re.escape(message)):
        app(args)


def streamed(url: str, body: dict) -> list[str]:
    """The data lines of a streamed answer until the server ends the stream."""
    conn, events = sse(url, body)
    try:
        return list(events)
    finally:
        conn.close()


@pytest.mark.parametrize("flags,message", [
    (["--replicas", "0"], "num_replicas (--replicas) must be at least 1, got 0"),
    (["--replicas", "2", "--threads", "0"], "--threads must be at least 1, got 0"),
    (["--replicas", "2", "--engine-restart"], "--engine-restart: Ray replaces a replica whose engine failed; drop "
                                              "--engine-restart"),
])
def test_dllm_serve_replicas_refuses_bad_flags_before_starting_ray(flags, message, capsys):
    assert main(["serve", "--port", "0", *flags]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


@pytest.mark.parametrize("replicas,threads,cpus,each", [(2, None, 2, 1), (1, None, 2, 2), (2, None, 5, 2),
                                                         (2, 2, 4, 2), (1, 1, 2, 1)])
def test_dllm_serve_replicas_shares_its_own_instance_cpus(replicas, threads, cpus, each):
    assert local_cpus(replicas, threads, cpus) == each


@pytest.mark.parametrize("replicas,threads,message", [
    (3, None, "--replicas 3 of 1 CPU(s) each need 3 CPUs, this machine has 2"),
    (2, 2, "--replicas 2 of 2 CPU(s) each need 4 CPUs, this machine has 2"),
])
def test_dllm_serve_replicas_refuses_more_cpus_than_its_instance_has(replicas, threads, message):
    with pytest.raises(dllm.DllmError, match=re.escape(message)):
        local_cpus(replicas, threads, 2)


def test_a_killed_replica_costs_only_its_requests_and_is_replaced(cluster, tiny):
    """8 requests of one prompt in flight, 4 on each replica (2 of them streamed); one replica's actor process is
    killed. Every request ends (none hangs) with the prompt's solo answer, or, where the dead replica held it, Ray's
    HTTP 500 (a stream: cut before its finish chunk and [DONE]). Ray starts a new replica and the deployment answers
    again with two."""
    model, tok = tiny
    prompt, params = "reverse: hello123", {"gen_length": 128, "ignore_eos": True}  # in flight when the replica dies
    results: list = [None] * 8

    def one(i):
        body = chat(prompt, **params)
        results[i] = streamed(cluster.url, body) if i % 4 == 0 else post(cluster.url + "/v1/chat/completions", body)

    started = cluster.first_blocks()
    clients = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for client in clients:
        client.start()
    cluster.wait_first_blocks(started, replicas=2)  # both decoding, 3 blocks to go
    victim = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith(f"SERVE_REPLICA::{APP_NAME}#"))
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    for client in clients:
        client.join(timeout=WAIT)
    assert not any(client.is_alive() for client in clients), "a request hung"
    failed = []
    want = dllm.generate(model, tok, prompt, gen_length=128, stop_early=False).texts[0]  # a row decodes as alone
    for result in results:
        if isinstance(result, list):  # streamed
            chunks = [json.loads(d) for d in result if d != "[DONE]"]
            if result[-1:] != ["[DONE]"]:
                assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
                failed.append("stream cut")
                continue
            assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want
        elif result[0] != 200:
            assert 500 <= result[0] < 600, result
            failed.append(f"{result[0]} {result[1]['error']['message']}")
        else:
            assert text_of(result[1]) == want
    assert 0 < len(failed) <= 4, failed  # the dead replica's requests, not the other's
    print(f"\nkilled a replica under load: {8 - len(failed)} of 8 answered as alone, {len(failed)} failed: "
          f"{', '.join(sorted(failed))}")
    deadline = time.monotonic() + WAIT
    while serve.status().applications[APP_NAME].deployments[APP_NAME].replica_states.get("RUNNING", 0) != 2:
        assert time.monotonic() < deadline, serve.status().applications[APP_NAME]
        time.sleep(0.5)
    results = post_all(cluster.url + "/v1/chat/completions", [chat("reverse: hello123")] * 4)
    assert [(status, text_of(answer)) for status, answer in results] == [(200, "#### 321olleh")] * 4


def test_a_deleted_application_lets_its_requests_finish(cluster, tiny):
    """What `dllm serve --replicas` does on SIGTERM: deleting the application stops each replica only after its
    requests in flight have finished (the app's lifespan then stops the engine)."""
    model, tok = tiny
    body = chat("reverse: hello123", gen_length=192, ignore_eos=True)
    answers, started = [], cluster.first_blocks()
    client = threading.Thread(target=lambda: answers.append(post(cluster.url + "/v1/chat/completions", body)))
    client.start()
    cluster.wait_first_blocks(started)  # 5 blocks to go
    serve.delete(APP_NAME)
    client.join(timeout=WAIT)
    (status, answer), = answers
    assert status == 200, answer
    assert text_of(answer) == dllm.generate(model, tok, "reverse: hello123", gen_length=192, stop_early=False).texts[0]


def test_dllm_serve_replicas_joins_a_running_cluster_and_leaves_on_sigterm(cluster):
    """`dllm serve --replicas 1 --ray-address ADDR` deploys onto this module's cluster (whose Serve proxy already
    listens), answers, and on SIGTERM removes its application and exits 0, leaving the cluster running."""
    if APP_NAME in serve.status().applications:  # left by a failed test above
        serve.delete(APP_NAME)
    address = ray.get_runtime_context().gcs_address
    proc = subprocess.Popen([sys.executable, "-m", "dllm.cli", "serve", "--replicas", "1", "--ray-address", address],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + WAIT
        while APP_NAME not in serve.status().applications or \
                serve.status().applications[APP_NAME].status != "RUNNING":
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else ""
            time.sleep(0.5)
        status, answer = post(cluster.url + "/v1/chat/completions", chat("reverse: hello123"))
        assert (status, text_of(answer)) == (200, "#### 321olleh")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT) == 0, proc.stdout.read()
    finally:
        proc.kill()
    assert APP_NAME not in serve.status().applications and ray.is_initialized()
