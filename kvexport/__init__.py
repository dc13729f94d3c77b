"""kvexport: Hugging Face decoder LLMs to ExecuTorch and ONNX artifacts that generate what eager
transformers generates, past the sliding window included. The Python API is ``kvexport.api``'s:
``export``, ``load``, ``check``, ``Artifact``; every user error is a ``KvexportError``."""

from .api import Artifact, check, export, load
from .errors import KvexportError
from .version import __version__

__all__ = ["Artifact", "KvexportError", "__version__", "check", "export", "load"]
