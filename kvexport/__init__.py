"""kvexport: Hugging Face decoder LLMs to ExecuTorch and ONNX artifacts that generate what eager
transformers generates, past the sliding window included."""

from .version import __version__

__all__ = ["__version__"]
