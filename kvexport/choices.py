"""The values an export option (and ``kvexport.json``) may take, one enum each. They are strings
(``StrEnum``): they compare equal to, print as, and serialise to their values, so a manifest's bytes
and a command line's words are the same as plain strings. What each target accepts of them is
declared by the target (``exporter/<target>/__init__.py``)."""

from __future__ import annotations

from enum import StrEnum

from .errors import InvalidOptionError


class Target(StrEnum):
    EXECUTORCH = "executorch"
    ONNX = "onnx"


class Dtype(StrEnum):
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"

    @property
    def bytes(self) -> int:
        return 4 if self is Dtype.FLOAT32 else 2


class KvCache(StrEnum):
    FLOAT = "float"  # the export's dtype
    INT8 = "int8"  # about a quarter of float32's bytes; each target's own scales


class Scheme(StrEnum):
    """``--quantize``: 4-bit linear weights."""

    INT8_DYNAMIC_INT4 = "8da4w"  # int8 dynamic activations, int4 weights (ExecuTorch, XNNPACK)
    INT4 = "int4"  # MatMulNBits (ONNX Runtime)


class EmbeddingScheme(StrEnum):
    INT8 = "int8"
    INT4 = "int4"


class LmHeadScheme(StrEnum):
    INT8 = "int8"  # the default: its rounding lands straight on the logits
    INT4 = "int4"  # smaller and faster, less exact


class Grid(StrEnum):
    """``--quantize-grid``: ``source`` (the default) keeps the grids the checkpoint's weights lie on,
    8-bit where it stores them finer than 4 bits; ``symmetric`` rounds every linear weight to
    symmetric int4 in groups of 32 as the peers' recipes do (ExecuTorch's 8da4w config, ONNX
    Runtime's symmetric MatMulNBits quantizer): fewer bytes and operators a step, further from float
    eager (docs/quantization.md)."""

    SOURCE = "source"
    SYMMETRIC = "symmetric"


class SdpaQuery(StrEnum):
    """``--sdpa-query`` (executorch, float KV cache): the query rows a call gives ExecuTorch's
    ``llama::custom_sdpa``. ``grouped`` stacks a decode step's query heads per KV head (each cached
    row read once a step) and gives longer calls one row more, so that every product is a matrix
    product; ``per-head`` is ExecuTorch's own call, one row per query head (a decode step's products
    matrix-vector ones). Which is faster depends on the BLAS the runtime links and the CPU;
    ``auto`` times both at the model's shape on the exporting machine and keeps per-head where it is
    clearly the faster (``exporter/executorch/sdpa_query.py``)."""

    AUTO = "auto"
    GROUPED = "grouped"
    PER_HEAD = "per-head"


class DecodeAttention(StrEnum):
    """``--decode-attention`` (executorch, float32): the kernel full-attention layers attend with in a
    call of up to ``kernels.MOST_TOKENS`` tokens (a decode step, a verification). ``custom-sdpa`` is
    ExecuTorch's (``llama::custom_sdpa``, or an int8 cache's ``--int8-kv-sdpa`` choice), in every
    ExecuTorch runtime; ``kvexport`` is kvexport's own (``kvexport/kernels``), split over the cached
    positions, reading an int8 cache in place, which the runtime must load (kvexport's runners do; a
    C++ runner links it)."""

    CUSTOM_SDPA = "custom-sdpa"
    KVEXPORT = "kvexport"


class Int8KvSdpa(StrEnum):
    """``--int8-kv-sdpa`` (executorch, int8 KV cache): the kernel a decode step attends with.
    ``quantized`` is ExecuTorch's ``llama::custom_quantized_sdpa``, which reads the int8 rows in place
    with torchao's int8 products: NEON micro-kernels on aarch64, a scalar fallback elsewhere.
    ``dequantized`` dequantizes the rows a step reads and attends with the float kernel,
    ``llama::custom_sdpa``. ``auto``: quantized where the exporting machine is aarch64, else
    dequantized (``exporter/executorch/target.py``)."""

    AUTO = "auto"
    QUANTIZED = "quantized"
    DEQUANTIZED = "dequantized"


def choose(kind: type[StrEnum], value, option: str) -> StrEnum:
    """``value`` as ``kind``'s member, or a one-line refusal naming ``option`` and the choices."""
    try:
        return kind(value)
    except ValueError:
        raise InvalidOptionError(f"unknown {option} '{value}'; choose one of: {', '.join(kind)}") from None
