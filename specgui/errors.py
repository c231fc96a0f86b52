"""The one exception type a user is allowed to see.

Everything the CLI or the app can blame on its input (a missing model, an empty prompt, a parameter out
of range, a malformed file) is raised as `SpecGUIError` with a single line that says what to do.
Front ends print that line and carry on; any other exception is a bug.
"""


class SpecGUIError(Exception):
    """A user-facing error whose message is one line, fit to show as is."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))
