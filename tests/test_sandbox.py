"""The sandbox that runs generated code: failures are contained and scored as failures."""
import time

from dllm.eval.sandbox import run_python


def test_passing_and_failing_programs():
    assert run_python("assert sorted([3, 1, 2]) == [1, 2, 3]").passed
    failed = run_python("assert 1 + 1 == 3, 'wrong sum'")
    assert not failed.passed and failed.status == "failed" and "wrong sum" in failed.detail


def test_infinite_loop_is_killed_at_the_timeout():
    start = time.perf_counter()
    outcome = run_python("while True:\n    pass", timeout=1)
    assert (outcome.passed, outcome.status) == (False, "timeout")
    assert time.perf_counter() - start < 5


def test_large_allocation_fails_within_the_memory_limit():
    outcome = run_python("block = bytearray(6 * 2**30)\nprint(len(block))", memory_mb=512)
    assert (outcome.passed, outcome.status) == (False, "failed") and "MemoryError" in outcome.detail


def test_writes_outside_the_temporary_directory_are_refused(tmp_path):
    target, keep = tmp_path / "written.txt", tmp_path / "keep.txt"
    keep.write_text("precious")
    for program in (f"open({str(target)!r}, 'w').write('x')",
                    f"import os\nos.remove({str(keep)!r})",
                    f"import shutil\nshutil.rmtree({str(tmp_path)!r})",
                    f"import pathlib\npathlib.Path({str(target)!r}).write_text('x')",
                    "import subprocess\nsubprocess.run(['touch', " + repr(str(target)) + "])"):
        outcome = run_python(program)
        assert not outcome.passed and "PermissionError" in outcome.detail, program
    assert not target.exists() and keep.read_text() == "precious"


def test_the_working_directory_is_a_writable_temporary_one_with_a_clean_environment(monkeypatch):
    monkeypatch.setenv("DLLM_SECRET", "leak")
    program = ("import os, pathlib\n"
               "assert os.path.basename(os.getcwd()).startswith('dllm-sandbox-')\n"
               "pathlib.Path('scratch.txt').write_text('ok')\n"
               "assert open('scratch.txt').read() == 'ok'\n"
               "assert 'DLLM_SECRET' not in os.environ\n")
    assert run_python(program).passed
