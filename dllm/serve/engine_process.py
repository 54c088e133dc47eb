"""The engine process: it loads the model, runs the `Engine` (the scheduler and the one decode loop) and talks to
the HTTP process only through ZeroMQ messages (`messages`): PULL for requests and aborts, PUSH for the answers'
tokens and the engine's numbers.

`dllm serve` starts it as its child (`EngineSpec.argv`: `main(SPEC, INBOX, OUTBOX, PARENT)`, SPEC the JSON of an
`EngineSpec`, PARENT the HTTP process's pid); tests may run the same `serve` on a thread beside the HTTP side (`engine_client.EngineClient`). The
loop: read the inbox (blocking up to a second while idle), run one block, send its outputs. The inbox is read
again after every step, so an abort stops its row at the next step, and the step's events go out then (rows that
asked for them). It leaves on `Shutdown` (exit 0, after the
requests in flight finished or its timeout ended them with 503), when the HTTP process has gone (exit 0, after
removing the sockets' folder, which the HTTP process would have removed), or on an
error, which it sends (`Exit` with the traceback) before it exits 1. SIGINT and SIGTERM are ignored: a terminal's
Ctrl-C or a service manager's signal reaches the whole process group, and the HTTP process drains the engine."""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from typing import Callable

from ..core.errors import DllmNotice
from ..models.parallel import RankFailed
from .messages import Abort, Add, Exit, Outputs, Ready, Shutdown, Steps, encode, to_engine
from .scheduler import Engine

IDLE_SECONDS = 1.0  # an idle engine sends its numbers, and checks that the HTTP process is there, this often (a
# busy one sends them after every block, and between steps where a block takes longer)


@dataclass
class EngineSpec:
    """What the engine process loads and runs: `dllm serve`'s model and engine flags (the Python names)."""

    model: str = "tiny-llada"
    device: str = "cpu"
    dtype: str | None = None
    threads: int | None = None  # torch's CPU threads (None: DLLM_THREADS, OMP_NUM_THREADS or the model's size)
    quantize: str | None = None
    quantize_head: bool = False
    max_batch: int = 8
    compile: bool = False
    prefix_cache_mb: float = 0
    tensor_parallel: int = 1  # N > 1: this process is rank 0 and starts ranks 1..N-1 as its children

    def load(self, weights: bool = True):
        """`dllm.load` of the model (`weights=False`: on the meta device, for the HTTP process's checks)."""
        import dllm

        return dllm.load(self.model, device=self.device, dtype=self.dtype, threads=self.threads,
                         quantize=self.quantize, quantize_head=self.quantize_head, weights=weights,
                         tensor_parallel=self.tensor_parallel)

    def engine(self) -> Engine:
        model, tokenizer = self.load()
        return Engine(model, tokenizer, self.max_batch, self.compile, self.prefix_cache_mb)

    def argv(self, inbox: str, outbox: str) -> list[str]:
        """The command line that runs this engine process as a child of this one."""
        run = f"import sys; from {__name__} import main; sys.exit(main(sys.argv[1:]))"  # (-m would import it twice)
        return [sys.executable, "-c", run, json.dumps(asdict(self)), inbox, outbox, str(os.getpid())]


def serve(make_engine: Callable[[], Engine], inbox: str, outbox: str, parent: int | None = None) -> int:
    """Build the engine (`make_engine`, which loads the model), say `Ready` and run it on the sockets at `inbox`
    (requests in) and `outbox` (outputs out) until told to stop; `parent`: the HTTP process's pid, whose end ends
    the engine. Returns the exit status."""
    import zmq

    context = zmq.Context()
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)  # never drop or block an answer
    push.setsockopt(zmq.LINGER, 5000)  # the last outputs and the Exit reach the HTTP process before the exit
    pull.connect(inbox)
    push.connect(outbox)
    try:
        engine = make_engine()
        push.send(encode(Ready(os.getpid())))
        reason = _run(engine, pull, push, parent)
        if reason == "orphaned":  # the HTTP process was killed and left the sockets' private folder: no one reads
            shutil.rmtree(os.path.dirname(inbox.removeprefix("ipc://")), ignore_errors=True)
            return 0
        push.send(encode(Exit(reason)))
        return 0
    except RankFailed as error:  # a rank of a tensor-parallel model has gone: one line says which, no traceback
        push.send(encode(Exit("error", "".join(traceback.format_exception_only(error)))))
        return 1
    except BaseException:  # noqa: BLE001  (sent to the HTTP process, which reports it)
        push.send(encode(Exit("error", traceback.format_exc())))
        return 1
    finally:
        pull.close(linger=0)
        push.close()
        context.term()


def _run(engine: Engine, pull, push, parent: int | None) -> str:
    """The engine's loop until a Shutdown has been carried out or the HTTP process has gone; returns why it ended."""
    import zmq

    deadline: list[float] = []  # set by a Shutdown
    sent = [time.monotonic()]  # when the numbers last went out

    def send(deltas: list) -> None:
        push.send(encode(Outputs(deltas, engine.stats())))
        sent[0] = time.monotonic()

    def receive(wait: float) -> None:
        """Apply the messages in the inbox, waiting up to `wait` seconds for the first."""
        if wait and not pull.poll(int(wait * 1000)):
            return
        while True:
            try:
                message = to_engine(pull.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            if isinstance(message, Add):
                engine.add(message)
            elif isinstance(message, Abort):
                engine.abort(message.req_ids)
            elif isinstance(message, Shutdown) and not deadline:
                engine.closing = True
                deadline.append(time.monotonic() + message.timeout)

    def between_steps() -> None:
        events = engine.take_steps()  # the step's events, before the block's outputs
        if events:
            push.send(encode(Steps(events)))
        receive(0)
        if time.monotonic() - sent[0] >= IDLE_SECONDS:  # a long block: the HTTP side still hears from us
            send([])
        if deadline and time.monotonic() >= deadline[0] and engine.tasks:
            engine.end_all(503, "the server shut down before the answer was complete")

    engine.poll, engine.wait = between_steps, receive
    while True:
        receive(0 if engine.busy or deadline else IDLE_SECONDS)
        if parent is not None and os.getppid() != parent:
            return "orphaned"
        if engine.model.tp is not None:
            engine.model.tp.ranks.check()  # an idle engine notices a rank that has exited
        between_steps()
        if engine.busy:
            engine.step()
        send(engine.take())
        if deadline and not engine.busy:
            return "shutdown"


def main(argv: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    warnings.simplefilter("ignore", DllmNotice)  # the HTTP side, reading the same registries, has said them
    spec, inbox, outbox, parent = EngineSpec(**json.loads(argv[0])), argv[1], argv[2], int(argv[3])
    return serve(spec.engine, inbox, outbox, parent)  # (the parent's pid as it started us: it may be gone already)

