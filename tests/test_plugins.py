"""Samplers and caches from other packages: an installed distribution's entry points (groups `dllm.samplers`,
`dllm.caches`) register when the registries are first read, so `dllm list`, `dllm generate`, `dllm eval` and
`dllm serve` take them by name; a plugin that fails to load is one note line naming it. The packages here are
"installed" as a `.dist-info` folder beside their module on PYTHONPATH, which is how importlib.metadata finds them."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dllm

ROOT = Path(__file__).resolve().parents[1]

PLUGIN = '''"""A sampler and a cache of a package other than dllm."""
from dataclasses import dataclass

from dllm.cache.blockwise import NoCache
from dllm.samplers import Commit, Sampler


@dataclass
class LeftToRight(Sampler):
    """Commit the leftmost masked position with its most probable token."""

    def step(self, ctx):
        first = ctx.eligible & (ctx.eligible.cumsum(-1) == 1)
        return Commit(first, ctx.logits.argmax(-1), first.float())


@dataclass
class EveryRow(NoCache):
    """Recompute every canvas row (the `none` cache, under another name)."""
'''


def install(folder: Path, name: str, module: str | None, entry_points: str) -> Path:
    """A distribution `name` in `folder`: its module (if any) and `<name>-0.1.dist-info` with its entry points."""
    folder.mkdir()
    if module is not None:
        (folder / f"{name}.py").write_text(module)
    info = folder / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points)
    return folder


def environment(*paths: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, paths), os.environ.get("PYTHONPATH", "")]),
            "DLLM_THREADS": "1"}


def dllm_cli(*args: str, path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dllm.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          env=environment(path), timeout=300)


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> Path:
    return install(tmp_path_factory.mktemp("site") / "packages", "dllm_demo_plugin", PLUGIN,
                   "[dllm.samplers]\nleft_to_right = dllm_demo_plugin:LeftToRight\n\n"
                   "[dllm.caches]\nevery_row = dllm_demo_plugin:EveryRow\n")


@pytest.fixture(scope="module")
def broken(tmp_path_factory) -> Path:
    return install(tmp_path_factory.mktemp("site") / "broken", "dllm_broken_plugin", "import no_such_module_here\n",
                   "[dllm.samplers]\nbroken = dllm_broken_plugin:Broken\n")


BROKEN_NOTE = ("note: sampler 'broken' of package dllm_broken_plugin (dllm.samplers: dllm_broken_plugin:Broken) is "
               "not loaded: ModuleNotFoundError: No module named 'no_such_module_here'")


def expected_answer(plugin: Path, tiny_llada, prompt: str) -> str:
    """The plugin's sampler and cache given to `dllm.generate` as objects, in this process."""
    sys.path.insert(0, str(plugin))
    try:
        import dllm_demo_plugin as module
    finally:
        sys.path.remove(str(plugin))
    model, tok = tiny_llada
    return dllm.generate(model, tok, [prompt], sampler=module.LeftToRight(), cache=module.EveryRow()).texts[0]


def test_an_installed_packages_sampler_and_cache_work_by_name(plugin, tiny_llada, tmp_path):
    listed = dllm_cli("list", "samplers", path=plugin)
    assert listed.returncode == 0 and listed.stderr == ""
    assert "left_to_right: Commit the leftmost masked position with its most probable token." in listed.stdout
    assert "\nevery_row: Recompute every canvas row" in dllm_cli("list", "caches", path=plugin).stdout
    run = dllm_cli("generate", "reverse: abcdef", "--sampler", "left_to_right", "--cache", "every_row", "--json",
                   path=plugin)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert [o["text"] for o in out["outputs"]] == [expected_answer(plugin, tiny_llada, "reverse: abcdef")]
    assert out["stats"]["tpf"] == pytest.approx(1.0)  # one position a step, as the rule says
    run = dllm_cli("eval", "--task", "synthetic", "--model", "tiny-llada", "--sampler", "left_to_right", "--cache",
                   "every_row", "--limit", "2", "--batch-size", "2", "--output", str(tmp_path), path=plugin)
    assert run.returncode == 0, run.stderr
    config = json.loads((tmp_path / "summary.json").read_text())["config"]
    assert (config["sampler"]["name"], config["cache"]["name"]) == ("left_to_right", "every_row")


def test_the_server_decodes_with_an_installed_packages_sampler(plugin, broken, tiny_llada):
    """A broken plugin beside it is one note line in the server's log (the engine process says nothing more)."""
    from conftest import serve

    pytest.importorskip("fastapi")
    from dllm.serve import post

    proc, url = serve("--model", "tiny-llada", env=environment(plugin, broken))
    try:
        status, answer = post(url + "/v1/chat/completions", {
            "model": "tiny-llada", "messages": [{"role": "user", "content": "reverse: abcdef"}],
            "sampler": "left_to_right", "cache": "every_row"})
    finally:
        proc.terminate()
        log = proc.communicate(timeout=60)[0]
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"] == expected_answer(plugin, tiny_llada, "reverse: abcdef")
    assert [line for line in log.splitlines() if "broken" in line] == [BROKEN_NOTE]


def test_a_plugin_that_fails_to_load_is_one_note_line(broken):
    listed = dllm_cli("list", "samplers", path=broken)
    assert listed.returncode == 0 and "\nthreshold: " in listed.stdout and "broken" not in listed.stdout
    assert listed.stderr.splitlines() == [BROKEN_NOTE]
    run = dllm_cli("generate", "reverse: abcdef", "--sampler", "broken", path=broken)
    assert run.returncode == 2 and "error: unknown sampler 'broken'" in run.stderr
