"""User-facing errors: the CLI prints their message as one line and exits non-zero.

Anything else that escapes is a bug in kvexport and keeps its traceback.
"""


class KvexportError(Exception):
    """A problem with the user's input or environment, with a message that says what to do."""

    exit_code = 2


class ModelNotFoundError(KvexportError):
    pass


class UnsupportedModelError(KvexportError):
    pass


class InvalidOptionError(KvexportError):
    pass


class InvalidModelError(KvexportError):
    """A model whose files disagree: a weight its config describes is not in the checkpoint, or
    one there has no place (or another shape) in the model its config builds."""


class ArtifactError(KvexportError):
    """A missing, corrupt or inconsistent artifact folder."""


class PromptTooLongError(KvexportError):
    pass


class ParityError(KvexportError):
    """The artifact does not generate what eager transformers generates."""

    exit_code = 1


class Interrupted(BaseException):
    """Raised by the SIGINT and SIGTERM handler of ``kvexport`` and ``python -m kvexport.device``. It
    unwinds like KeyboardInterrupt, so ``finally`` and ``except BaseException`` blocks remove
    half-written output (and an archive's unpacked copy), but is not one: typer turns a
    KeyboardInterrupt into a silent exit 130, and SIGTERM deserves its own code (128 + 15)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def first_line(e: BaseException) -> str:
    """The first line of an error's message (its type's name where it has none), for a one-line message."""
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]
