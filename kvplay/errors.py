"""The one exception type a user sees: a single clear sentence, never a traceback."""


class KvplayError(ValueError):
    """Bad input or an impossible request, worded for the person who made it.

    Subclasses ValueError so library callers can catch it the usual way; the CLI
    prints it and exits 2, the UI turns it into gr.Error.
    """
