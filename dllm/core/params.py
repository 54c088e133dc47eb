"""Typed, validated parameters and name registries for samplers and caches.

A policy is a dataclass whose fields are declared with `param(default, doc, ge=..., ...)`; values given as
strings (CLI `KEY=VALUE`) are converted by the field's type, and every bad value is a one-line `DllmError`.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import math
import types
import typing
import warnings
from typing import Any, ClassVar

from .checks import choose_from
from .errors import DllmError, DllmNotice


FLOAT_SMALLEST, FLOAT_LARGEST = 1e-30, 1e30  # a float parameter's magnitude (0 aside): what float32 math survives
INT_LARGEST = 2 ** 31 - 1  # an integer parameter's: a count or an index


def param(default: Any, doc: str, *, ge: float | None = None, le: float | None = None, gt: float | None = None,
          lt: float | None = None, choices: tuple | None = None, allow_inf: bool = False) -> Any:
    """A policy parameter. Floats must be finite unless `allow_inf` (e.g. a threshold that inf switches off)."""
    return dataclasses.field(default=default, metadata=dict(doc=doc, ge=ge, le=le, gt=gt, lt=lt, choices=choices,
                                                            allow_inf=allow_inf))


def _options(hint: Any) -> tuple:
    """The types an annotation allows (`float | None` -> float, NoneType)."""
    union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    return typing.get_args(hint) if union else (hint,)


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """`typing.get_type_hints(cls)`, read once per class (it evaluates every annotation: a millisecond a call)."""
    return typing.get_type_hints(cls)


def is_numeric(hint: Any) -> bool:
    """An int or float parameter (possibly None); a bool is not a number here."""
    return bool({int, float} & set(_options(hint)))


def _convert(value: Any, hint: Any, where: str) -> Any:
    """Convert `value` to the annotated type (`float`, `int`, `bool`, `str`, or `X | None`). Strings (CLI
    `KEY=VALUE`) are parsed; a bool is never taken as a number, nor a number other than 0/1 as a bool, nor NaN
    as a float."""
    options = _options(hint)
    if value is None or (isinstance(value, str) and value.lower() == "none"):
        if type(None) in options:
            return None
        raise DllmError(f"{where} cannot be None; give a value")
    kind = next(t for t in options if t is not type(None))
    bad = DllmError(f"{where} must be {kind.__name__}, got {value!r}")
    if kind in (int, float) and isinstance(value, bool):
        raise bad
    try:
        if kind is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                return value.lower() in ("true", "1", "yes")
            if value not in (0, 1):
                raise ValueError
            return bool(value)
        if kind is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if kind is float:
            converted = float(value)
        else:
            return kind(value)
    except (TypeError, ValueError):
        raise bad from None
    if math.isnan(converted):
        raise DllmError(f"{where} must be a number, got nan")
    return converted


def _params(obj) -> list[dataclasses.Field]:
    """The user-settable fields (state kept with `field(init=False)` is not a parameter)."""
    return [f for f in dataclasses.fields(obj) if f.init]


@dataclasses.dataclass
class Params:
    """Base of every sampler and cache: validates its fields after construction."""

    kind: ClassVar[str] = "policy"
    name: ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = type_hints(type(self))
        for f in _params(self):
            where = f"{self.kind} {self.name!r} parameter {f.name}"
            value = _convert(getattr(self, f.name), hints[f.name], where)
            setattr(self, f.name, value)
            m = f.metadata
            if value is None or not m:
                continue
            if isinstance(value, float) and math.isinf(value) and not m.get("allow_inf"):
                raise DllmError(f"{where} must be finite, got {value}; give a number")
            if isinstance(value, float) and not math.isinf(value) and value and not \
                    FLOAT_SMALLEST <= abs(value) <= FLOAT_LARGEST:
                raise DllmError(f"{where}={value} is out of range; give 0 or a magnitude between {FLOAT_SMALLEST} "
                                f"and {FLOAT_LARGEST} (it enters float32 tensors)")
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT_LARGEST:
                raise DllmError(f"{where}={value} is out of range; it must be at most {INT_LARGEST} in magnitude")
            for key, ok, word in (("ge", lambda v, b: v >= b, ">="), ("le", lambda v, b: v <= b, "<="),
                                  ("gt", lambda v, b: v > b, ">"), ("lt", lambda v, b: v < b, "<")):
                if m.get(key) is not None and not ok(value, m[key]):
                    raise DllmError(f"{where}={value} is out of range; it must be {word} {m[key]}")
            if m.get("choices") and value not in m["choices"]:
                raise DllmError(f"{where}={value!r} is not one of {', '.join(map(str, m['choices']))}")

    def config(self) -> dict[str, Any]:
        return {"name": self.name, **{f.name: getattr(self, f.name) for f in _params(self)}}

    @classmethod
    def describe(cls) -> dict[str, Any]:
        hints = type_hints(cls)
        doc = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())  # the first paragraph, whole
        return {"name": cls.name, "doc": doc, "params": [
            {"name": f.name, "type": str(hints[f.name]).replace("<class '", "").replace("'>", ""),
             "default": f.default, "doc": f.metadata.get("doc", "")} for f in _params(cls)]}

    @classmethod
    def param_names(cls) -> list[str]:
        return [f.name for f in _params(cls)]


class Registry:
    """Name -> policy class, with creation from keyword arguments that reports every mistake in one line.

    Installed packages add to it through entry points of the group `dllm.<kind>s` (`dllm.samplers`, `dllm.caches`),
    each `name = "module:Class"`, registered under its name the first time the registry is read (not when it is
    made: a plugin imports the package that makes it). A plugin that fails to load is a one-line `DllmNotice`."""

    def __init__(self, kind: str, base: type[Params]):
        self.kind, self.base = kind, base
        self.group = f"dllm.{kind}s"
        self._classes: dict[str, type[Params]] = {}
        self._plugins_read = False

    @property
    def classes(self) -> dict[str, type[Params]]:
        """Every registered class by name, the installed plugins' included."""
        if not self._plugins_read:
            self._plugins_read = True
            self._read_plugins()
        return self._classes

    @classes.setter
    def classes(self, classes: dict[str, type[Params]]) -> None:
        self._classes = classes

    def _read_plugins(self) -> None:
        for entry in importlib.metadata.entry_points(group=self.group):
            try:
                self.register(entry.name)(entry.load())
            except Exception as e:  # whatever a broken plugin raises, dllm goes on without it
                package = f"package {entry.dist.name}" if entry.dist is not None else "an installed package"
                warnings.warn(f"{self.kind} {entry.name!r} of {package} ({self.group}: {entry.value}) is not "
                              f"loaded: {type(e).__name__}: {' '.join(str(e).split())}", DllmNotice, stacklevel=2)

    def register(self, name: str):
        def add(cls: type[Params]) -> type[Params]:
            if not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise DllmError(f"{self.kind} {name!r}: register a dataclass subclass of {self.base.__name__}, "
                                f"got {cls!r}")
            known = self._classes.get(name)
            if known is not None and known is not cls and \
                    (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):  # a re-run cell
                raise DllmError(f"{self.kind} {name!r} is already registered; pick another name")
            cls.name, cls.kind = name, self.kind
            self._classes[name] = cls
            return cls
        return add

    def get(self, name: str) -> type[Params]:
        if not isinstance(name, str) or name not in self.classes:
            raise DllmError(f"unknown {self.kind} {name!r}; {choose_from(name, list(self.classes))} "
                            f"(`dllm list {self.kind}s` shows them all with their parameters)")
        return self.classes[name]

    def create(self, name: str | Params, **params: Any) -> Params:
        if isinstance(name, Params):
            if params:
                raise DllmError(f"parameters {', '.join(params)} given with a ready {self.kind} object; "
                                f"set them on the object instead")
            return name
        cls = self.get(name)
        unknown = sorted(set(params) - set(cls.param_names()))
        if unknown:
            valid = ", ".join(cls.param_names()) or "none"
            raise DllmError(f"unknown parameter {unknown[0]!r} for {self.kind} {name!r}; valid: {valid}")
        return cls(**params)

    def __iter__(self):
        return iter(self.classes.values())
