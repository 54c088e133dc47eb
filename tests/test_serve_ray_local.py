"""`dllm serve --replicas` on a Ray instance of its own (issue #44): every process it starts listens on loopback only,
a cluster that cannot be reached or does not answer is one error line in bounded time, and what a replica would
refuse is refused before Ray starts."""
import ipaddress
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request

import psutil
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install -e '.[ray]'")

from dllm.cli import main  # noqa: E402
from dllm.core.errors import DllmError  # noqa: E402
from dllm.serve.ray import local_ray_dir  # noqa: E402

WAIT = 120  # seconds any one wait may take (nothing hangs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(session: int) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket of the processes in `session`."""
    pids = {p.pid: p.name() for p in psutil.process_iter() if _session(p.pid) == session}
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


def test_a_local_ray_instance_listens_on_loopback_only():
    """Every listening socket of every process `dllm serve --replicas 1 --host 127.0.0.1` starts (Ray's GCS, raylet,
    agents, Serve's controller, proxy and replica, the driver) is on loopback; it answers there, and leaves on
    SIGTERM with exit 0."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dllm.cli", "serve", "--replicas", "1", "--host", "127.0.0.1",
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own session: Ray's processes are found by it
    try:
        deadline = time.monotonic() + WAIT
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else ""
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(1)
        folder = local_ray_dir()  # Ray's folders (sessions, logs, the raylet's and object store's sockets) are in
        # a folder private to the user, not in the shared /tmp/ray that Ray opens to every local user
        assert stat.S_IMODE(os.lstat(folder).st_mode) == 0o700 and os.lstat(folder).st_uid == os.getuid()
        socket_files = [arg.split("=", 1)[1] for p in psutil.process_iter() if _session(p.pid) == proc.pid
                        for arg in _cmdline(p) if arg.startswith(("--raylet_socket_name=", "--store_socket_name="))]
        assert socket_files and all(path.startswith(folder + os.sep) for path in socket_files), socket_files
        sockets = listening(proc.pid)
        print("\n" + "\n".join(f"{name:24} {ip}:{p}" for name, ip, p in sockets))
        assert len({name for name, _, _ in sockets}) >= 5, sockets  # Ray's own processes were found
        assert ("127.0.0.1", port) in {(ip, p) for _, ip, p in sockets}
        assert [s for s in sockets if not loopback(s[1])] == []
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT) == 0, proc.stdout.read()
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
