"""The ranks of tensor parallelism on `torch.distributed` (spec `parallel_and_engine.md` part A4): one process per
rank, gloo on a CPU and NCCL on CUDA for the model's collectives, a gloo group for rank 0's calls to the others.

Rank 0 is the caller's process: `dllm.load(..., tensor_parallel=N)` starts ranks 1..N-1 as its children (or, under
`torchrun`, finds them there), and they follow it (`follow`): rank 0 runs the caller's program, and every call that
must run on every rank (a model's load, a batch's steps, see `dllm.engine.lockstep.Lockstep`) is posted to the others
(`Ranks.post`), which make the same call on their own objects. An object rank 0 shares (`Ranks.share`: a model, a
batch) is known to the others by a key and built on each by a call, so a call's arguments name it and each rank reads
its own (its shard of the model, its copy of the batch). The calls travel in order, pickled, broadcast on the gloo
group when rank 0 next needs the others (`Ranks.send`); nothing is decided twice, so every rank takes the same
decisions from the same numbers (the merged statistics of `sharded_logits`, the all-reduced activations).

A rank that fails ends the run: gloo answers a collective with a closed connection at once, a hung rank after
`DLLM_TP_TIMEOUT` seconds (default 300); rank 0 turns either into one-line `RankFailed`, naming the rank whose process
exited where it can. A rank whose rank 0 has gone exits.
"""
from __future__ import annotations

import atexit
import datetime
import io
import itertools
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import Counter
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ..core.errors import DllmError

CONTROL_TIMEOUT = datetime.timedelta(days=365)  # the other ranks wait for rank 0's next call this long
START_SECONDS = 120.0  # the other ranks have this long to start


class RankFailed(DllmError):
    """A rank of the group failed or left: the group cannot go on (load the model again)."""


def timeout_seconds() -> float:
    value = os.environ.get("DLLM_TP_TIMEOUT", "300").strip()
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise DllmError(f"DLLM_TP_TIMEOUT must be a positive number of seconds, got {value!r}")
    return seconds


class Traffic:
    """Collectives and the bytes each rank sends in them, by kind (`layer`, `embedding`, `experts`, `sampler`,
    `gather`, `check`, `control`): an all-reduce or all-gather of `n` bytes per rank counts `n`."""

    def __init__(self):
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def count(self, kind: str, nbytes: int) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += nbytes

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """`{kind: (calls, bytes)}` so far."""
        return {kind: (self.calls[kind], self.bytes[kind]) for kind in self.calls}


class Ranks:
    """This process's place in the tensor-parallel group: its rank, the group's size, the device, the model's
    collectives (counted in `traffic`) and rank 0's calls to the others."""

    def __init__(self, rank: int, size: int, device: torch.device, followers: list[subprocess.Popen] | None = None,
                 directory: str | None = None):
        self.rank, self.size, self.device = rank, size, device
        self.followers, self.directory = followers or [], directory  # ranks 1.. this process started
        # the other ranks wait for rank 0's next call without end; rank 0's sends time out as the collectives do
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT if rank else
                                      datetime.timedelta(seconds=timeout_seconds()))
        self.traffic = Traffic()
        self.pending: list[tuple] = []  # rank 0's calls not yet sent
        self.keys = itertools.count(1)
        self.failure: str | None = None  # why the group cannot go on

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # -- collectives ----------------------------------------------------------------------------------------------
    def all_reduce(self, t: Tensor, kind: str) -> Tensor:
        """`t` summed over the ranks (in place)."""
        self.traffic.count(kind, t.numel() * t.element_size())
        self._collective(lambda: dist.all_reduce(t))
        return t

    def all_gather(self, t: Tensor, kind: str) -> Tensor:
        """`[size, *t.shape]`: every rank's `t` (equal shapes), rank order."""
        flat = t.reshape(-1).contiguous()
        self.traffic.count(kind, flat.numel() * flat.element_size())
        out = flat.new_empty(self.size * flat.numel())
        self._collective(lambda: dist.all_gather_single(out, flat))
        return out.view(self.size, *t.shape)

    def _collective(self, run: Callable[[], Any]) -> Any:
        if self.failure is not None:
            raise RankFailed(self.failure)
        try:
            return run()
        except Exception as error:  # noqa: BLE001  (a rank died, hung, or the group broke: one line)
            raise self.failed(error) from None

    def failed(self, error: BaseException) -> RankFailed:
        """The group cannot go on: a one-line error naming the rank that exited, where this process started it."""
        time.sleep(0.2)  # a dead rank's exit status arrives just after its connection closes
        gone = [(rank, p.poll()) for rank, p in enumerate(self.followers, 1) if p.poll() is not None]
        if gone:
            rank, code = gone[0]
            why = f"tensor-parallel rank {rank} exited (code {code})"
        elif not self.leader and isinstance(error, RuntimeError) and "closed" in str(error).lower():
            why = "tensor-parallel rank 0 has gone"
        elif "timed out" in str(error).lower() or "timeout" in str(error).lower():
            why = f"a tensor-parallel rank did not answer within {timeout_seconds():g} s (DLLM_TP_TIMEOUT)"
        else:
            why = f"a tensor-parallel collective failed ({type(error).__name__}: {_first_line(error)})"
        self.failure = f"{why}; the model's ranks cannot go on, load it again"
        return RankFailed(self.failure)

    def check(self) -> None:
        """Raise `RankFailed` if a rank this process started has exited (an idle server's look at its ranks)."""
        if self.failure is None and any(p.poll() is not None for p in self.followers):
            self.failure = self.failed(RuntimeError("exited")).args[0]
        if self.failure is not None:
            raise RankFailed(self.failure)

    # -- rank 0's calls ------------------------------------------------------------------------------------------
    def share(self, obj: Any, make: Callable, *args) -> None:
        """Rank 0: the other ranks build their own `obj` by `make(*args)` (arguments naming shared objects get each
        rank's own) when rank 0 next sends; calls naming `obj` reach theirs, and they drop it when rank 0 does."""
        key = next(self.keys)
        self.post(_keep, key, make, *args)
        self.adopt(obj, key)

    def build(self, make: Callable, *args) -> int:
        """Rank 0: the other ranks build an object by `make(*args)` now; returns its key, for rank 0's own (`adopt`)."""
        key = next(self.keys)
        self.send(_keep, key, make, *args)
        return key

    def adopt(self, obj: Any, key: int) -> None:
        obj._tp_key = key
        weakref.finalize(obj, self._forget, key)

    def _forget(self, key: int) -> None:
        if self.failure is None:
            self.post(_forget, key)

    def agree(self, ok: bool, what: str) -> None:
        """Every rank: raise `RankFailed` on every rank unless every rank says `ok` (`what` failed on the others)."""
        said = self.all_gather(torch.tensor([int(ok)], device=self.device), "control")[:, 0].tolist()
        if not all(said):
            rank = said.index(0)
            raise RankFailed(f"tensor-parallel rank {rank} could not {what} (its error is above)")

    def post(self, fn: Callable, *args) -> None:
        """Rank 0: the other ranks call `fn(*args)` (in the order posted), when rank 0 next sends."""
        self.pending.append((fn, args))

    def send(self, fn: Callable | None = None, *args) -> None:
        """Rank 0: send the posted calls (and `fn(*args)`); the other ranks make them now."""
        if fn is not None:
            self.post(fn, *args)
        calls, self.pending = self.pending, []
        message = [[_dumps(call) for call in calls]]  # each read after the calls before it ran (they may share)
        self.traffic.count("control", sum(map(len, message[0])))
        self._collective(lambda: dist.broadcast_object_list(message, src=0, group=self.control))

    def receive(self):
        """The other ranks: rank 0's next calls, each `(fn, args)` with shared objects as this rank's own, read one
        at a time as the caller makes them."""
        message = [None]
        self._collective(lambda: dist.broadcast_object_list(message, src=0, group=self.control))
        return (_Unpickler(io.BytesIO(call)).load() for call in message[0])

    def close(self) -> None:
        """Rank 0: tell the other ranks to exit, wait for those this process started, leave the group, remove the
        directory where they met."""
        global RANKS
        if self.leader and self.failure is None:
            try:
                self.send(_exit)
            except RankFailed:
                pass
        for p in self.followers:
            if self.failure is not None:  # out of step with rank 0 (e.g. waiting in a collective): it cannot exit
                p.kill()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        OBJECTS.clear()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.directory is not None:  # the file store the ranks met at
            shutil.rmtree(self.directory, ignore_errors=True)
        RANKS = None


RANKS: Ranks | None = None  # this process's group, once a tensor-parallel model has loaded
OBJECTS: dict[int, Any] = {}  # the other ranks: their own shared objects, by rank 0's keys


def _dumps(obj) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer).dump(obj)
    return buffer.getvalue()


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        key = getattr(obj, "_tp_key", None) if not isinstance(obj, type) else None
        return key if isinstance(key, int) else None


class _Unpickler(pickle.Unpickler):
    def persistent_load(self, key):
        return OBJECTS[key]


def _keep(key: int, make: Callable, *args) -> None:
    obj = make(*args)
    obj._tp_key = key
    OBJECTS[key] = obj


def _forget(key: int) -> None:
    OBJECTS.pop(key, None)


class _Exit(Exception):
    pass


def _exit() -> None:
    raise _Exit


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:200]


def backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device: on CUDA its own GPU (torchrun's LOCAL_RANK, else the rank), else `device`."""
    if device.type != "cuda":
        return device
    index = int(os.environ.get("LOCAL_RANK", rank))
    if index >= torch.cuda.device_count():
        raise DllmError(f"tensor-parallel rank {rank} needs GPU {index}, and this machine has "
                        f"{torch.cuda.device_count()}; use as many ranks as GPUs")
    return torch.device("cuda", index)


def ranks(size: int, device: torch.device) -> Ranks:
    """This process's group of `size` ranks, started at the first call: under `torchrun` (WORLD_SIZE set) the
    processes it started, where rank 0 returns and every other rank follows rank 0 until it exits (this call never
    returns there); otherwise ranks 1..size-1 are started as children of this process, which is rank 0."""
    global RANKS
    if RANKS is not None:
        if RANKS.size != size:
            raise DllmError(f"this process already runs {RANKS.size} tensor-parallel ranks; load every model with "
                            f"tensor_parallel={RANKS.size}")
        return RANKS
    timeout = datetime.timedelta(seconds=timeout_seconds())
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:  # under torchrun
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if world != size:
            raise DllmError(f"torchrun started {world} processes for tensor_parallel={size}; start as many "
                            f"(--nproc-per-node {size})")
        device = rank_device(device, rank)
        dist.init_process_group(backend(device), init_method="env://", rank=rank, world_size=size, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
        RANKS = Ranks(rank, size, device)
        if rank:
            sys.exit(follow(RANKS))
    else:
        RANKS = _start(size, device, timeout)
    atexit.register(lambda: RANKS is not None and RANKS.close())
    return RANKS


def _start(size: int, device: torch.device, timeout: datetime.timedelta) -> Ranks:
    """Start ranks 1..size-1 as children (each `follower_main`), meet them at a file store in a private directory,
    and make the group; a child that exits first is a one-line error. The ranks share this machine, so gloo and
    NCCL's bootstrap listen on the loopback interface only (unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME say
    otherwise): nothing of the group is reachable from the network."""
    loopback = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    if loopback is not None:
        for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(variable, loopback)
    directory = tempfile.mkdtemp(prefix="dllm-tp-")
    spec = {"size": size, "device": str(device), "directory": directory, "timeout": timeout.total_seconds(),
            "threads": torch.get_num_threads(), "parent": os.getpid()}
    run = "import sys; from dllm.models.parallel import follower_main; sys.exit(follower_main(sys.argv[1]))"
    followers = [subprocess.Popen([sys.executable, "-c", run, json.dumps({**spec, "rank": rank})],
                                  stdout=subprocess.DEVNULL) for rank in range(1, size)]
    store = dist.FileStore(os.path.join(directory, "store"), size)
    deadline = time.monotonic() + START_SECONDS
    while store.add("started", 0) < size - 1:  # the children's ranks, before anyone waits inside torch
        gone = [(rank, p.poll()) for rank, p in enumerate(followers, 1) if p.poll() is not None]
        if gone or time.monotonic() > deadline:
            for p in followers:
                p.kill()
            why = f"exited (code {gone[0][1]})" if gone else f"did not start within {START_SECONDS:.0f} s"
            raise RankFailed(f"tensor-parallel rank {gone[0][0] if gone else 1} {why}; see its error above")
        time.sleep(0.05)
    device = rank_device(device, 0)
    dist.init_process_group(backend(device), store=store, rank=0, world_size=size, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    return Ranks(0, size, device, followers, directory)


def follower_main(spec_json: str) -> int:
    """A rank other than 0, started by rank 0 (`_start`): join the group, then follow rank 0 until it exits."""
    global RANKS
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the group: rank 0 ends this rank
    spec = json.loads(spec_json)
    torch.set_num_threads(spec["threads"])
    rank, size = spec["rank"], spec["size"]
    device = rank_device(torch.device(spec["device"]), rank)
    store = dist.FileStore(os.path.join(spec["directory"], "store"), size)
    store.add("started", 1)
    dist.init_process_group(backend(device), store=store, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=spec["timeout"]),
                            device_id=device if device.type == "cuda" else None)
    RANKS = Ranks(rank, size, device)
    _watch_parent(spec["parent"])
    return follow(RANKS)


def _watch_parent(parent: int) -> None:
    """Exit when rank 0's process has gone (a killed rank 0 leaves no one to end the group)."""
    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, name="dllm-tp-parent", daemon=True).start()


def follow(ranks: Ranks) -> int:
    """The other ranks' loop: make rank 0's calls in order until it says exit. Rank 0 made every call it posts
    without an error (and a block's `DllmError`, which every rank raises alike, is caught where it runs), so any
    error here means this rank left rank 0's path: it ends this rank, and rank 0 hears of it at its next collective.
    Returns the exit status."""
    try:
        while True:
            for fn, args in ranks.receive():
                fn(*args)
    except _Exit:
        OBJECTS.clear()
        dist.destroy_process_group()
        return 0
    except RankFailed as error:
        print(f"dllm: {error}", file=sys.stderr)
        return 1
