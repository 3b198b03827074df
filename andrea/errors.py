"""The one exception type a user can cause; the CLI prints its message as one sentence."""


class AndreaError(Exception):
    """Bad input or a state the user can fix: the message names the file/field and what to do."""
