"""The exceptions ``lowprec`` raises for bad input, so a caller can catch every one of them at once.

Each also derives from the built-in exception it replaces (``ValueError``, ``TypeError``), so code that
caught those keeps working.
"""


class LowprecError(Exception):
    """Base of every error ``lowprec`` raises for an argument, recipe or model it cannot use."""


class LowprecValueError(LowprecError, ValueError):
    """A value out of what is allowed (the message names the argument, the value and what is allowed)."""


class LowprecTypeError(LowprecError, TypeError):
    """An argument of the wrong type (the message names the argument, its type and what is allowed)."""
