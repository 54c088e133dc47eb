"""A non-editable install (`pip install .`, a wheel) holds every module and data file: setup.cfg names each package
and each data file (issue #39: dllm.core, dllm.engine and dllm.serve were missing, so only `pip install -e` ran)."""
import configparser
import fnmatch

from conftest import ROOT

CFG = configparser.ConfigParser()
CFG.read(ROOT / "setup.cfg")
NOT_INSTALLED = {"eval/data/pack.py"}  # the script that wrote the packaged data
MOVED = dict(line.replace(" ", "").split("=") for line in CFG["options"]["package_dir"].strip().splitlines())


def folder(package: str):
    """Where a package's files are in the checkout (`package_dir`: dllm.eval is eval/)."""
    return ROOT / MOVED[package] if package in MOVED else ROOT.joinpath(*package.split("."))


def test_every_package_is_listed():
    listed = {p.strip() for p in CFG["options"]["packages"].split(",")}
    found = {*MOVED, *(".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "dllm").rglob("__init__.py"))}
    assert listed == found


def owned_data(root) -> list[str]:
    """Files of the package at `root` that are no module: in its subfolders that are no package themselves."""
    out = []
    for f in root.rglob("*"):
        rel = f.relative_to(root)
        between = [root.joinpath(*rel.parts[:i]) for i in range(1, len(rel.parts))]
        if f.is_file() and between and not any((d / "__init__.py").exists() for d in between) \
                and "__pycache__" not in rel.parts and str(f.relative_to(ROOT)) not in NOT_INSTALLED:
            out.append(str(rel))
    return out


def test_every_data_file_is_listed():
    """Files in a package's subfolders that are no package (checkpoints, data, the lm-eval tasks) match its globs."""
    globs = {package: [g.strip() for g in value.split(",")] for package, value in CFG["options.package_data"].items()}
    for package in (p.strip() for p in CFG["options"]["packages"].split(",")):
        missing = [f for f in owned_data(folder(package))
                   if not any(fnmatch.fnmatch(f, g) for g in globs.get(package, []))]
        assert not missing, (package, missing)
