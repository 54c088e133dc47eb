"""Final answers of math solutions: the last \\boxed{...}, a normal form, and equivalence of two answers."""
from __future__ import annotations

import re
from fractions import Fraction
from math import gcd

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_DROP = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "\\$", "$", "\\displaystyle", "^\\circ", "^{\\circ}",
         "\\circ", "°", "\\%", "%")
_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox)\{([^{}]*)\}")
_UNIT_WORDS = re.compile(r"(\d)\s*\\(?:text|mbox|mathrm)\{\s*[a-zA-Z ]+\}$")
_FRAC_SHORT = re.compile(r"\\frac\s*(\d)\s*(\d)")
_FRAC_HALF_SHORT = re.compile(r"\\frac\{([^{}]*)\}(\d)|\\frac(\d)\{([^{}]*)\}")
_SQRT_SHORT = re.compile(r"\\sqrt(\w)")
_VARIABLE_PREFIX = re.compile(r"^[a-zA-Z]\s*=\s*")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?|-?\.\d+")
_FRAC = re.compile(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}")
_SLASH = re.compile(r"(-?\d+)/(\d+)")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}, or `\\boxed x`) in `text`; None if there is none."""
    start, command = max((text.rfind(cmd), cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    rest = text[start + len(command):]
    if rest.startswith(" "):  # `\boxed 5`
        return rest.split("$")[0].strip() or None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return rest[1:i].strip()
    return None


def normalize(answer: str) -> str:
    """A normal form in which equal answers written differently (spacing, \\dfrac, units, `x =`) coincide."""
    s = answer.strip().replace("\n", "").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _UNIT_WORDS.sub(r"\1", s)
    s = s.replace("\\\\", "\n")  # a row break, kept apart from the spacing command `\ `
    for token in _DROP:
        s = s.replace(token, "")
    s = s.replace("\n", "\\\\")
    s = _WRAPPERS.sub(r"\1", s).strip()
    s = _VARIABLE_PREFIX.sub("", s) if s.count("=") == 1 else s
    s = _FRAC_SHORT.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC_HALF_SHORT.sub(lambda m: f"\\frac{{{m[1]}}}{{{m[2]}}}" if m[1] is not None
                             else f"\\frac{{{m[3]}}}{{{m[4]}}}", s)
    s = _SQRT_SHORT.sub(r"\\sqrt{\1}", s)
    s = s.replace(" ", "").rstrip(".")
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    if s.startswith("."):
        s = "0" + s
    return s


def _value(s: str) -> Fraction | None:
    """The exact value of a plain number, `a/b` or `\\frac{a}{b}`; None for anything else."""
    for pattern, make in ((_FRAC, lambda m: Fraction(int(m[2]), int(m[3])) * (-1 if m[1] else 1)),
                          (_SLASH, lambda m: Fraction(int(m[1]), int(m[2]))),
                          (_NUMBER, lambda m: Fraction(m[0]))):
        m = pattern.fullmatch(s)
        if m:
            try:
                return make(m)
            except ZeroDivisionError:
                return None
    return None


def _unreduced(s: str) -> bool:
    """A fraction not in lowest terms, or over 1 (`2/4`, `\\frac{4}{2}`): not a final answer (PRM800K's grader)."""
    m = _FRAC.fullmatch(s) or _SLASH.fullmatch(s)
    if m is None:
        return False
    num, den = (int(m[2]), int(m[3])) if m.re is _FRAC else (int(m[1]), int(m[2]))
    return abs(den) == 1 or gcd(num, den) != 1


def equivalent(prediction: str | None, reference: str) -> bool:
    """Equal normal forms, or equal values when both are numbers or fractions (a fraction in lowest terms)."""
    if prediction is None:
        return False
    a, b = normalize(prediction), normalize(reference)
    if a == b:
        return True
    va, vb = _value(a), _value(b)
    return va is not None and va == vb and not _unreduced(a)
