"""The one exception type a user can cause; the CLI prints its message as one sentence."""


class AndreaError(Exception):
    """Bad input or a state the user can fix: the message names the file/field and what to do."""


def error_sentence(err: Exception) -> str:
    """The one sentence the command line prints for an error a user can meet: an AndreaError's message, or
    for an OSError (disk full, I/O error, permissions) the file and the cause, no traceback."""
    if isinstance(err, OSError):
        return f"{err.filename + ': ' if err.filename else ''}{err.strerror or err}"
    return str(err)
