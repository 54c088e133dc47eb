"""The package's layers import one way: core -> models -> policies (samplers, cache; never each other) ->
engine -> eval -> serve -> cli. Each module is imported alone in a clean interpreter and every `dllm` module it pulls
in must sit in its own layer or a lower one."""
import json
import pkgutil
import subprocess
import sys

import dllm

LAYERS = [  # (layer, module prefixes): one folder each
    ("core", ("dllm.core",)),
    ("models", ("dllm.models",)),
    ("samplers", ("dllm.samplers",)),
    ("cache", ("dllm.cache",)),
    ("engine", ("dllm.engine",)),
    ("eval", ("dllm.eval",)),
    ("serve", ("dllm.serve",)),
    ("cli", ("dllm.cli",)),
]
RANK = {"core": 0, "models": 1, "samplers": 2, "cache": 2, "engine": 3, "eval": 4, "serve": 5, "cli": 6}


def layer_of(module: str) -> str | None:
    matches = [(len(p), name) for name, prefixes in LAYERS for p in prefixes
               if module == p or module.startswith(p + ".")]
    return max(matches)[1] if matches else None


def all_modules() -> list[str]:
    found = ["dllm", "dllm.samplers", "dllm.cache", "dllm.eval"]
    for info in pkgutil.walk_packages(dllm.__path__, "dllm."):
        found.append(info.name)
    for sub in ("samplers", "cache", "eval", "models"):
        package = __import__(f"dllm.{sub}", fromlist=["_"])
        found += [info.name for info in pkgutil.walk_packages(package.__path__, f"dllm.{sub}.")]
    return sorted(name for name in set(found) if not name.endswith(".__main__"))  # `python -m` runs it


PROBE = """
import importlib, json, sys
out = {}
for name in json.loads(sys.argv[1]):
    for loaded in [m for m in sys.modules if m == "dllm" or m.startswith("dllm.")]:
        del sys.modules[loaded]
    importlib.import_module(name)
    out[name] = sorted(m for m in sys.modules if m.startswith("dllm."))
print(json.dumps(out))
"""


def test_every_module_imports_only_its_layer_and_below():
    modules = [m for m in all_modules() if layer_of(m) is not None]
    assert {layer_of(m) for m in modules} == set(RANK), modules  # every layer is found
    run = subprocess.run([sys.executable, "-c", PROBE, json.dumps(modules)], capture_output=True, text=True,
                         check=True)
    wrong = upward_imports(json.loads(run.stdout))
    assert not wrong, "\n".join(wrong)


def upward_imports(imported: dict[str, list[str]]) -> list[str]:
    """`module (layer) imports other (layer)` for each pulled-in module of a higher or a sibling layer."""
    wrong = []
    for module, pulled in imported.items():
        mine = layer_of(module)
        for other in pulled:
            theirs = layer_of(other)
            if theirs is None:
                continue
            if RANK[theirs] > RANK[mine] or (RANK[theirs] == RANK[mine] and theirs != mine):
                wrong.append(f"{module} ({mine}) imports {other} ({theirs})")
    return wrong


def test_importing_the_core_leaves_the_engine_unloaded():
    run = subprocess.run([sys.executable, "-c", "import sys, dllm.core.params; print(sorted(sys.modules))"],
                         capture_output=True, text=True, check=True)
    assert "dllm.engine" not in run.stdout and "dllm.models" not in run.stdout


def test_the_tree_holds_only_layer_folders_and_the_command_line():
    """dllm/ reads bottom to top as the layers: a module outside the layer folders would sit in no layer."""
    top = sorted(info.name for info in pkgutil.iter_modules(dllm.__path__))
    assert top == ["cli", "core", "engine", "models", "serve"]


def test_an_upward_import_is_caught(tmp_path):
    """The check fails on a module that imports a higher layer (a core module importing the engine)."""
    probe = tmp_path / "probe.py"
    probe.write_text("import dllm.engine\n")
    run = subprocess.run([sys.executable, "-c", PROBE.replace("importlib.import_module(name)",
                                                              "importlib.import_module(name); exec(open(sys.argv[2]).read())"),
                          json.dumps(["dllm.core.errors"]), str(probe)], capture_output=True, text=True, check=True)
    assert "dllm.core.errors (core) imports dllm.engine (engine)" in upward_imports(json.loads(run.stdout))


def test_the_distribution_installs_one_top_level_package():
    """The folders samplers/, cache/ and eval/ install inside dllm (setup.cfg package_dir), not as top-level
    packages that clash with others."""
    from importlib.metadata import distribution

    assert distribution("dllm-fast").read_text("top_level.txt").split() == ["dllm"]
