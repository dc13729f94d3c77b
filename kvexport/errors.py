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


class ArtifactError(KvexportError):
    """A missing, corrupt or inconsistent artifact folder."""


class PromptTooLongError(KvexportError):
    pass


class ParityError(KvexportError):
    """The artifact does not generate what eager transformers generates."""

    exit_code = 1
