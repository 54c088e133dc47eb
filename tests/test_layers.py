"""The package's layers import one way: core -> models -> policies (samplers, cache; never each other) ->
engine -> eval -> serve -> cli. Each module is imported alone in a clean interpreter and every `dllm` module it pulls
in must sit in its own layer or a lower one; and no module imports itself back through others (no circles)."""
import ast
import importlib.util
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


def imports_of(module: str, source: str, modules: set[str]) -> set[str]:
    """The `dllm` modules `module` imports, counting every import statement (inside functions and `TYPE_CHECKING`
    too): `from P import name` imports P (a package's `__init__`, where its names live) and P.name if that is a
    module; `import a.b` and `from a.b import x` import a.b."""
    package = module if importlib.util.find_spec(module).submodule_search_locations else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            base = ".".join(part for part in (base, node.module) if part)
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return (found & modules) - {module}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import graph's circles: each strongly connected set of two or more modules (Tarjan), sorted."""
    index, low, stack, found = {}, {}, [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(members) > 1:
                found.append(sorted(members))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def import_graph() -> dict[str, set[str]]:
    modules = set(all_modules())
    return {m: imports_of(m, open(importlib.util.find_spec(m).origin).read(), modules) for m in modules}


def test_no_module_imports_itself_back():
    """No circle in the whole package: not between layers, not between modules of one layer, not through a
    package's `__init__` (a registry module taking `register` from its package, which imports it)."""
    found = circles(import_graph())
    assert not found, "\n".join(" -> ".join(circle) for circle in found)


def test_a_circle_is_caught():
    """The check finds a module taking a name back from its package's `__init__` (which imports the module), a
    circle through a `TYPE_CHECKING` import, and one inside a function."""
    modules = {"dllm.samplers", "dllm.samplers.wino", "dllm.engine.loop", "dllm.engine.lockstep", "dllm.engine.api",
               "dllm.engine.stats"}
    sources = {"dllm.samplers": "from . import wino", "dllm.samplers.wino": "from . import register",
               "dllm.engine.loop": "from .lockstep import x",
               "dllm.engine.lockstep": "if TYPE_CHECKING:\n    from .loop import Batch",
               "dllm.engine.api": "def f():\n    from .stats import Stats", "dllm.engine.stats": "from .api import x"}
    graph = {module: imports_of(module, source, modules) for module, source in sources.items()}
    assert circles(graph) == [["dllm.engine.api", "dllm.engine.stats"], ["dllm.engine.lockstep", "dllm.engine.loop"],
                              ["dllm.samplers", "dllm.samplers.wino"]]
