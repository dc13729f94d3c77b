"""What ``--quantize``, ``--quantize-embedding``, ``--quantize-lm-head`` and ``--quantize-grid`` ask for, checked before
anything loads. Each target applies it: ExecuTorch quantizes the module before export
(``executorch/quantize.py``), ONNX the saved graph's weights (``onnx/quantize.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidOptionError

# The export options that choose a quantization (ExportOptions' fields, and matrix rows' keys).
OPTIONS = ("quantize", "quantize_embedding", "quantize_lm_head", "quantize_grid")
# --quantize: the scheme, and the one target that runs it.
SCHEMES = {"8da4w": "executorch", "int4": "onnx"}
# --quantize-embedding (ExecuTorch): kvexport's name -> ExecuTorch's quantize_model_ config.
EMBEDDING_SCHEMES = {"int8": "8w", "int4": "4w"}
# --quantize-lm-head (with 8da4w or int4): int8 (the default: its rounding lands straight on the
# logits), or int4 (smaller and faster, less exact).
LM_HEAD_SCHEMES = ("int8", "int4")
# --quantize-grid (with 8da4w or int4): "source" (the default) keeps the grids the checkpoint's
# weights lie on, 8-bit where it stores them finer than 4 bits; "symmetric" rounds every linear
# weight to symmetric int4 in groups of 32 as the peers' recipes do (ExecuTorch's 8da4w config,
# ONNX Runtime's symmetric MatMulNBits quantizer): fewer bytes and operators a step, further
# from float eager (docs/quantization.md).
GRIDS = ("source", "symmetric")
# --kv-cache: the export's dtype ("float", every target's), or int8 (ExecuTorch: a scale and zero
# point per row; ONNX: fixed scales per channel); the targets that take each.
KV_CACHES = {"float": None, "int8": ("executorch", "onnx")}


def check_kv_cache(kv_cache: str, target: str) -> None:
    if kv_cache not in KV_CACHES:
        raise InvalidOptionError(f"unknown --kv-cache '{kv_cache}'; choose one of: {', '.join(KV_CACHES)}")
    if KV_CACHES[kv_cache] is not None and target not in KV_CACHES[kv_cache]:
        raise InvalidOptionError(
            f"--kv-cache {kv_cache} is not available for --target {target} in this version; "
            f"--target {' or '.join(KV_CACHES[kv_cache])} takes it"
        )


@dataclass(frozen=True)
class Quantization:
    """What ``--quantize``, ``--quantize-embedding``, ``--quantize-lm-head`` and ``--quantize-grid``
    ask for (None: not asked), carried as one value from the command line to the target that applies it."""

    scheme: str | None = None  # --quantize: "8da4w" (executorch) or "int4" (onnx)
    embedding: str | None = None  # --quantize-embedding: "int8" or "int4" (executorch)
    lm_head: str | None = None  # --quantize-lm-head: "int8" (the default) or "int4", with scheme
    grid: str | None = None  # --quantize-grid: "source" (the default) or "symmetric", with scheme

    @property
    def symmetric(self) -> bool:
        """Every linear weight rounded to symmetric int4 (``--quantize-grid symmetric``)."""
        return self.grid == "symmetric"

    def __bool__(self) -> bool:  # whether anything is quantized (an lm_head scheme alone is refused)
        return bool(self.scheme or self.embedding)

    def check(self, target: str, dtype: str) -> None:
        """Refuse, before anything loads, a scheme that does not exist or that the target does not run."""
        scheme, embedding, lm_head, grid = self.scheme, self.embedding, self.lm_head, self.grid
        if scheme is not None and scheme not in SCHEMES:
            choices = ", ".join(f"{s} (--target {t})" for s, t in SCHEMES.items())
            raise InvalidOptionError(f"unknown --quantize '{scheme}'; choose one of: {choices}")
        if scheme is not None and SCHEMES[scheme] != target:
            right = next(s for s, t in SCHEMES.items() if t == target)
            raise InvalidOptionError(
                f"--quantize {scheme} is for --target {SCHEMES[scheme]}; for --target {target} use --quantize {right}"
            )
        if embedding is not None:
            if target != "executorch":
                raise InvalidOptionError(
                    f"--quantize-embedding is for --target executorch; for --target {target} leave it out "
                    "(--quantize int4 quantizes the embedding too)"
                )
            if embedding not in EMBEDDING_SCHEMES:
                raise InvalidOptionError(
                    f"unknown --quantize-embedding '{embedding}'; choose one of: {', '.join(EMBEDDING_SCHEMES)}"
                )
        if lm_head is not None:
            if lm_head not in LM_HEAD_SCHEMES:
                raise InvalidOptionError(f"unknown --quantize-lm-head '{lm_head}'; choose one of: {', '.join(LM_HEAD_SCHEMES)}")
            if scheme is None:
                raise _needs_scheme("--quantize-lm-head", target)
        if grid is not None:
            if grid not in GRIDS:
                raise InvalidOptionError(f"unknown --quantize-grid '{grid}'; choose one of: {', '.join(GRIDS)}")
            if scheme is None:
                raise _needs_scheme("--quantize-grid", target)
        if (scheme or embedding) and dtype != "float32":
            raise InvalidOptionError(f"--quantize takes --dtype float32 (the default), not {dtype}; leave --dtype out")


def _needs_scheme(option: str, target: str) -> InvalidOptionError:
    right = next(s for s, t in SCHEMES.items() if t == target)
    return InvalidOptionError(f"{option} goes with --quantize {right} (--target {target}); add it, or leave {option} out")
