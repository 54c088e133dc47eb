import warnings


class DllmError(ValueError):
    """Bad input from a user: the message is one line that names the fix."""


class DllmNotice(UserWarning):
    """Not an error, but worth knowing (e.g. a prompt outside what a tiny model was trained on); the command lines
    print it as one `note:` line (`one_line_notice`)."""


_PYTHON_FORMAT = warnings.formatwarning


def one_line_notice(message, category, filename, lineno, line=None) -> str:
    """A `warnings.formatwarning` that writes a `DllmNotice` as one `note: ...` line, other warnings as Python does."""
    if issubclass(category, DllmNotice):
        return f"note: {message}\n"
    return _PYTHON_FORMAT(message, category, filename, lineno, line)
