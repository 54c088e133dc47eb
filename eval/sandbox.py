"""Run generated Python and its tests in a contained child process.

The child is a fresh isolated interpreter (`python -I -B`) with a clean environment, its own session (so a
timeout kills its whole process group), a temporary working directory, limits on address space, CPU time
and file size, and an audit hook that refuses writes outside the temporary directory and the start of other
processes. This contains mistakes of generated code; it is not a security boundary against hostile code.
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

TIMEOUT_SECONDS = 10.0
MEMORY_MB = 1024
MAX_FILE_MB = 16

# Runs in the child before the program: limits, then the write guard, then the program as __main__.
_PREAMBLE = r"""
import os, resource, sys
tmp, memory, cpu, fsize = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, fsize),
                     (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
root = os.path.realpath(tmp)
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
PATH_EVENTS = {"os.remove", "os.rmdir", "os.rename", "os.mkdir", "os.chmod", "os.chown", "os.link", "os.symlink",
               "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.copytree", "shutil.move"}
PROCESS_EVENTS = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                  "os.forkpty", "os.kill", "os.killpg", "pty.spawn", "ctypes.dlopen"}

def inside(path):
    real = os.path.realpath(os.fsdecode(path))
    return real == os.devnull or real == root or real.startswith(root + os.sep)

def guard(event, args):
    if event == "open":
        path, mode, flags = args
        writes = (mode is not None and any(c in mode for c in "wax+")) or bool(flags & WRITE_FLAGS)
        if writes and isinstance(path, (str, bytes, os.PathLike)) and not inside(path):
            raise PermissionError(f"sandbox: no writes outside the working directory ({path})")
    elif event in PATH_EVENTS:
        for path in args:
            if isinstance(path, (str, bytes, os.PathLike)) and not inside(path):
                raise PermissionError(f"sandbox: {event} outside the working directory ({path})")
    elif event in PROCESS_EVENTS:
        raise PermissionError(f"sandbox: {event} is not allowed")

sys.addaudithook(guard)
del resource, guard
sys.argv = ["program.py"]
with open("program.py") as f:
    source = f.read()
exec(compile(source, "program.py", "exec"), {"__name__": "__main__"})
"""


@dataclass(frozen=True)
class Outcome:
    passed: bool
    status: str  # "passed", "failed" or "timeout"
    detail: str  # last line of the child's stderr (the exception), empty when passed


def run_python(source: str, timeout: float = TIMEOUT_SECONDS, memory_mb: int = MEMORY_MB) -> Outcome:
    """Run `source` as a program; it passes when it exits with status 0 within `timeout` seconds."""
    with tempfile.TemporaryDirectory(prefix="dllm-sandbox-") as tmp:
        Path(tmp, "program.py").write_text(source)
        env = {"PATH": os.defpath, "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}
        limits = [str(memory_mb << 20), str(math.ceil(timeout) + 1), str(MAX_FILE_MB << 20)]
        proc = subprocess.Popen([sys.executable, "-I", "-B", "-c", _PREAMBLE, tmp, *limits], cwd=tmp, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True)
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return Outcome(False, "timeout", f"no exit within {timeout:g} s")
    if proc.returncode == 0:
        return Outcome(True, "passed", "")
    lines = err.decode(errors="replace").strip().splitlines()
    reason = lines[-1] if lines else f"killed by signal {-proc.returncode}" if proc.returncode < 0 else ""
    return Outcome(False, "failed", reason[:300])
