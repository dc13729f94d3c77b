"""kvexport: Hugging Face decoder LLMs to ExecuTorch and ONNX artifacts that generate what eager
transformers generates, past the sliding window included."""

__version__ = "0.1.0"
