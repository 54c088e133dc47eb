class DllmError(ValueError):
    """Bad input from a user: the message is one line that names the fix."""
