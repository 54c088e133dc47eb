"""Argument checks shared by every layer: each bad value is a one-line `DllmError` naming the argument."""
from __future__ import annotations

import difflib
import numbers
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import DllmError


def check_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """`value` as an int (any integer type, e.g. numpy's; a bool, float or string is a one-line error naming
    `name`)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise DllmError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise DllmError(f"{name} must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise DllmError(f"{name} must be at most {maximum}, got {value}")
    return value


MAX_SEED = 2**63 - 1  # torch.Generator seeds are 64-bit


def check_seed(seed: Any) -> int:
    return check_int("seed", seed, 0, MAX_SEED)

def choose_from(name: Any, choices: Sequence[str], prefix: str = "") -> str:
    """What follows "unknown X 'name'; " in an error: the closest choices (difflib's similarity at least 0.6 and
    near the best one's), else all of them; each written after `prefix` (`random:`)."""
    scored = sorted(((difflib.SequenceMatcher(None, name, c).ratio(), c) for c in choices), reverse=True) \
        if isinstance(name, str) and choices else []
    close = [c for ratio, c in scored if ratio >= max(0.6, scored[0][0] - 0.05)][:3]
    if close:
        return f"did you mean {' or '.join(repr(prefix + c) for c in close)}?"
    return f"choose one of {', '.join(prefix + c for c in choices)}"


def check_output_dir(output: str | Path, flag: str = "--output") -> None:
    """Fail before any work if `output` cannot hold the results (tried: root ignores permission bits)."""
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise DllmError(f"{flag} {output} is a file; give a directory")
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        raise DllmError(f"{flag} {output}: {existing} is a file; give a directory path")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise DllmError(f"{flag} {output} is not writable ({existing}: {e.strerror}); choose another "
                        f"directory") from None
