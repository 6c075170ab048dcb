"""User-facing errors: the CLI prints their message on one line and exits non-zero, never a traceback."""


class AscqError(Exception):
    """An error caused by the user's input or environment, with a message that says what to do."""


class UnsupportedError(AscqError):
    """A model, checkpoint format, scheme or device that ascq does not support."""
