"""User-facing errors.

A `MarianaError` is a problem with the user's input (flag, config file, data path, record). The CLI prints
it as one line, ``mariana: error: <message>``, and exits with status 2, without a traceback. Anything
else is a bug and keeps its traceback.
"""


class MarianaError(Exception):
    """Bad input from the user; the message names the file/line/field and what was expected."""

    exit_code = 2


class DataError(MarianaError):
    """A data set cannot be read at all (missing, empty, wrong layout)."""
