"""The sandbox that runs generated code: failures are contained and scored as failures, and hostile programs are
stopped by the operating system (bubblewrap namespaces), checked through the function the scorers call.

Every escape program runs to its end only if its escape worked, so `passed` means escaped; the host files they aim at
are checked unchanged afterwards."""
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from dllm.core.errors import DllmError
from dllm.eval import sandbox
from dllm.eval.sandbox import run_python

isolated = pytest.mark.skipif(sandbox.isolation_problem() is not None,
                              reason=f"no sandbox here: {sandbox.isolation_problem()}")


@pytest.fixture(params=[False, True], ids=["isolated", "unsafe"])
def unsafe(request):
    if not request.param and sandbox.isolation_problem() is not None:
        pytest.skip(sandbox.isolation_problem())
    return request.param


def test_passing_and_failing_programs(unsafe):
    assert run_python("assert sorted([3, 1, 2]) == [1, 2, 3]", unsafe=unsafe).passed
    failed = run_python("assert 1 + 1 == 3, 'wrong sum'", unsafe=unsafe)
    assert not failed.passed and failed.status == "failed" and "wrong sum" in failed.detail


@pytest.mark.parametrize("exit", ["import sys\nsys.exit(0)", "import os\nos._exit(0)", "raise SystemExit"])
def test_a_program_that_exits_before_its_end_fails(unsafe, exit):
    """Generated code that exits with status 0 before the tests appended to it has not passed them."""
    outcome = run_python(f"{exit}\nassert False, 'the tests'", unsafe=unsafe)
    assert (outcome.passed, outcome.detail) == (False, "exit status 0 before the end of the program")


def test_the_pass_signal_cannot_be_forged_by_a_fixed_exit(unsafe):
    """Exiting with the harness's own exit code, after printing anything, is not reaching the end."""
    program = f"import os\nprint('x')\nos._exit({sandbox.RAN_TO_THE_END})\nassert False, 'the tests'"
    outcome = run_python(program, unsafe=unsafe)
    assert not outcome.passed and outcome.status == "failed"
    assert run_python("print('a lot of output ' * 1000)", unsafe=unsafe).passed


def test_a_main_block_of_generated_code_does_not_run(unsafe):
    """As in the HumanEval / MBPP harnesses: `if __name__ == "__main__": unittest.main()` stays out of the way."""
    program = "import unittest\nif __name__ == '__main__':\n    unittest.main()\nassert 1 + 1 == 2"
    assert run_python(program, unsafe=unsafe).passed


WRONG = "def answer(x):\n    return 0.0\n"  # every assert below fails on it, unless the program cheats
RIGHT = "def answer(x):\n    return {3.5: 0.5, 1: 1, 2: 1.0}[x]\n"
CHEATS = {
    "builtins.abs patched": "import builtins\nbuiltins.abs = lambda x: 0.0",
    "builtins.isinstance patched": "import builtins\nbuiltins.isinstance = lambda *a: True",
    "__builtins__ rebound": "import builtins\n__builtins__ = dict(vars(builtins), abs=lambda x: 0.0, "
                            "isinstance=lambda *a: True)",
    "a global named like a builtin": "abs = lambda x: 0.0\nisinstance = lambda *a: True",
    "a module the tests use patched": "import math\nmath.isclose = lambda *a, **k: True",
}
ASSERTS = {"builtins.abs patched": ["abs(candidate(3.5) - 0.5) < 1e-6"],
           "builtins.isinstance patched": ["isinstance(candidate(1), int)"],
           "__builtins__ rebound": ["abs(candidate(3.5) - 0.5) < 1e-6", "isinstance(candidate(1), int)"],
           "a global named like a builtin": ["abs(candidate(3.5) - 0.5) < 1e-6", "isinstance(candidate(1), int)"],
           "a module the tests use patched": ["math.isclose(candidate(2), 1.0)"]}
TESTS = {cheat: "import math\n\ndef check(candidate):\n" + "".join(f"    assert {a}\n" for a in asserts) +
         "\ncheck(answer)\n" for cheat, asserts in ASSERTS.items()}  # HumanEval's form


@pytest.mark.parametrize("cheat", CHEATS)
def test_a_program_that_patches_what_the_tests_use_still_fails_them(unsafe, cheat):
    """Reward hacking: a wrong answer that patches builtins (or a module the asserts call) before the tests. The
    tests run against the interpreter as it started and fail; appended to the program, as the scorers ran them
    before, every cheat passes; a right answer still passes with the cheat beside it."""
    program, tests = WRONG + CHEATS[cheat] + "\n", TESTS[cheat]
    outcome = run_python(program, tests=tests, keep=("answer",), unsafe=unsafe)
    assert not outcome.passed and outcome.detail.startswith("AssertionError"), outcome
    assert run_python(program + tests, unsafe=unsafe).passed
    assert run_python(RIGHT + CHEATS[cheat] + "\n", tests=tests, keep=("answer",), unsafe=unsafe).passed


def test_a_tested_function_named_like_a_builtin_is_the_programs():
    """MBPP 126 asks for `sum(a, b)`: the tests call the program's `sum`, and its gold solution passes."""
    from dllm.eval import tasks
    items, _ = tasks.get_task("mbpp").load(None, 0)
    item = next(it for it in items if it.id == "mbpp-126")
    assert item.tested == ("sum",)
    assert tasks.get_task("mbpp").score(item, item.gold, unsafe_exec=True)["pass@1"][1]
    assert not tasks.get_task("mbpp").score(item, "def sum(a, b):\n    return 0\n", unsafe_exec=True)["pass@1"][1]


def test_infinite_loop_is_killed_at_the_timeout(unsafe):
    start = time.perf_counter()
    outcome = run_python("while True:\n    pass", timeout=1, unsafe=unsafe)
    assert (outcome.passed, outcome.status) == (False, "timeout")
    assert time.perf_counter() - start < 3


def test_the_default_timeout_is_human_evals_3_seconds(unsafe):
    outcome = run_python("import time\ntime.sleep(4)", unsafe=unsafe)
    assert (outcome.passed, outcome.status) == (False, "timeout")
    assert run_python("import time\ntime.sleep(1)", unsafe=unsafe).passed


def test_large_allocation_fails_within_the_memory_limit(unsafe):
    outcome = run_python("block = bytearray(6 * 2**30)\nprint(len(block))", memory_mb=512, unsafe=unsafe)
    assert (outcome.passed, outcome.status) == (False, "failed") and "MemoryError" in outcome.detail


def test_the_working_directory_is_writable_and_the_environment_clean(monkeypatch, unsafe):
    monkeypatch.setenv("DLLM_SECRET", "leak")
    program = ("import os, pathlib\n"
               "pathlib.Path('scratch.txt').write_text('ok')\n"
               "assert open('scratch.txt').read() == 'ok'\n"
               "assert 'DLLM_SECRET' not in os.environ\n")
    assert run_python(program, unsafe=unsafe).passed


@pytest.fixture
def host(tmp_path):
    """Host files an escape aims at: a file to keep, a folder whose listing must not change."""
    keep = tmp_path / "keep.txt"
    keep.write_text("precious")
    os.chmod(tmp_path, 0o777)  # even a world-writable host folder stays out of reach
    yield tmp_path
    assert keep.read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def _escapes(host, listener_port):
    target, keep = str(host / "written"), str(host / "keep.txt")
    parent_pid = os.getpid()
    return {
        "open for writing": f"open({target!r}, 'w').write('x')",
        "os.open with dir_fd": f"import os\nfd = os.open({str(host)!r}, os.O_RDONLY)\n"
                               f"os.close(os.open('written', os.O_CREAT | os.O_WRONLY, dir_fd=fd))",
        "unlink with dir_fd": f"import os\nos.unlink('keep.txt', dir_fd=os.open({str(host)!r}, os.O_RDONLY))",
        "rename with dir_fd": f"import os\nfd = os.open({str(host)!r}, os.O_RDONLY)\n"
                              f"os.rename('keep.txt', 'written', src_dir_fd=fd, dst_dir_fd=fd)",
        "sqlite3 database": f"import sqlite3\nsqlite3.connect({target!r}).execute('create table t (x)')",
        "mkfifo": f"import os\nos.mkfifo({target!r})",
        "unix socket bind": f"import socket\nsocket.socket(socket.AF_UNIX).bind({target!r})",
        "_posixsubprocess.fork_exec": textwrap.dedent(f"""\
            import _posixsubprocess, os, time
            pid = _posixsubprocess.fork_exec([b'/usr/bin/touch', {target.encode()!r}], [b'/usr/bin/touch'], True,
                (), None, None, -1, -1, -1, -1, -1, -1, *os.pipe(), False, False, 0, None, None, None, -1,
                None, False)
            time.sleep(0.5)
            open({target!r})"""),
        "subprocess touch": f"import subprocess\nsubprocess.run(['touch', {target!r}], check=True)\nopen({target!r})",
        "shutil.rmtree": f"import shutil\nshutil.rmtree({str(host)!r})",
        "read /etc/shadow": "print(open('/etc/shadow').read()[:1])",
        "read the parent's environ": textwrap.dedent("""\
            import os
            def leaks(pid):
                try:
                    return b'DLLM_PARENT_SECRET' in open(f'/proc/{pid}/environ', 'rb').read()
                except OSError:
                    return False
            assert any(leaks(pid) for pid in os.listdir('/proc') if pid.isdigit())"""),
        "see the scorer's process": f"import os\nos.kill({parent_pid}, 0)",
        "kill the scorer": f"import os, signal\nos.kill({parent_pid}, signal.SIGTERM)",
        "tcp to 127.0.0.1": f"import socket\nsocket.create_connection(('127.0.0.1', {listener_port}), timeout=2)",
        "tcp to the internet": "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)",
        "write under /usr": "open('/usr/dllm-escape', 'w')",
        "write the python installation": f"open({os.path.join(os.path.realpath(sys.base_prefix), 'dllm-escape')!r}, 'w')",
        "become root": "import os\nos.setuid(0)",
        "a user namespace of its own (every capability in it)":
            "import ctypes\nassert ctypes.CDLL(None).unshare(0x10000000 | 0x20000) == 0",
        "any effective capability": "assert int(open('/proc/self/status').read().split('CapEff:')[1].split()[0], 16)",
        "root uid": "import os\nassert os.getuid() == 0 or os.geteuid() == 0",
        "see the home folders": "import os\nassert os.listdir('/root') or os.listdir('/home')",
        "symlink to a host file": f"import os\nos.symlink({keep!r}, 'link')\nassert open('link').read() == 'precious'",
        "fill the disk": "f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * 2**20)",
    }


@isolated
def test_escape_attempts_are_stopped(host, monkeypatch):
    monkeypatch.setenv("DLLM_PARENT_SECRET", "leak")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        escapes = _escapes(host, listener.getsockname()[1])
        assert len(escapes) >= 20
        outcomes = {name: run_python(program, timeout=5) for name, program in escapes.items()}
    assert not [name for name, outcome in outcomes.items() if outcome.passed]


@isolated
def test_a_setsid_grandchild_holding_stderr_dies_with_the_program(host):
    """The program exits at once; its detached grandchild would keep stderr open and write later."""
    marker = "31.4159"
    program = textwrap.dedent(f"""\
        import os, sys
        if os.fork() == 0:
            os.setsid()
            os.execv('/usr/bin/sleep', ['sleep', '{marker}'])
        print('bye', file=sys.stderr)
        raise SystemExit(1)""")
    start = time.perf_counter()
    outcome = run_python(program, timeout=3)
    assert time.perf_counter() - start < 3 + 2 and outcome.status == "failed"
    time.sleep(0.2)
    assert subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True).stdout == b""


@isolated
@pytest.mark.parametrize("bomb", ["fork", "memory", "threads"])
def test_bombs_are_bounded(bomb):
    program = {"fork": "import os\nwhile True:\n    os.fork()",
               "memory": "blocks = []\nwhile True:\n    blocks.append(bytearray(2**26))",
               "threads": "import threading, time\nwhile True:\n"
                          "    threading.Thread(target=time.sleep, args=(60,)).start()"}[bomb]
    start = time.perf_counter()
    outcome = run_python(program, timeout=3)
    assert not outcome.passed and time.perf_counter() - start < 3 + 2
    time.sleep(0.2)
    survivors = subprocess.run(["pgrep", "-u", str(sandbox.NOBODY)], capture_output=True).stdout.split()
    assert not survivors or os.geteuid() != 0  # as root the sandbox runs as nobody: none of them is left


@isolated
def test_a_fork_heavy_program_leaves_its_neighbours_their_processes():
    """The process limit is per program (each runs in a user namespace of its own, where the kernel counts its
    processes): 63 sleepers in one program do not stop another's subprocess.run."""
    from concurrent.futures import ThreadPoolExecutor
    hog = "import os, time\nfor _ in range(63):\n    if os.fork() == 0:\n        time.sleep(4)\n        os._exit(0)\n" \
          "time.sleep(4)"
    with ThreadPoolExecutor(2) as pool:
        hogging = pool.submit(run_python, hog, 8)
        time.sleep(1.5)
        neighbour = run_python("import subprocess\nsubprocess.run(['true'], check=True)")
        hogging.result()
    assert neighbour.passed, neighbour.detail


def test_without_bubblewrap_nothing_runs_unless_unsafe(monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name, path=None: None)
    sandbox.isolation_problem.cache_clear()
    try:
        with pytest.raises(DllmError, match=r"^generated code runs only in an isolated sandbox, but bubblewrap "
                                            r"\(bwrap\) is not installed; install bubblewrap .*--unsafe-exec"):
            run_python("print(1)")
        assert run_python("print(1)", unsafe=True).passed
    finally:
        sandbox.isolation_problem.cache_clear()


def test_a_code_task_without_bubblewrap_stops_before_any_work(monkeypatch, tmp_path, capsys):
    from dllm.cli import main

    monkeypatch.setattr(sandbox.shutil, "which", lambda name, path=None: None)
    sandbox.isolation_problem.cache_clear()
    try:
        code = main(["eval", "--task", "humaneval", "--gold", "--limit", "2", "--output", str(tmp_path / "he")])
    finally:
        sandbox.isolation_problem.cache_clear()
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "bubblewrap (bwrap) is not installed" in err
    assert not (tmp_path / "he").exists()


def test_unsafe_guard_still_refuses_writes_outside_its_directory(host):
    for program in (f"open({str(host / 'written')!r}, 'w').write('x')",
                    f"import os\nos.remove({str(host / 'keep.txt')!r})",
                    "import subprocess\nsubprocess.run(['touch', " + repr(str(host / "written")) + "])"):
        outcome = run_python(program, unsafe=True)
        assert not outcome.passed and "PermissionError" in outcome.detail, program
