"""What ``--quantize``, ``--quantize-embedding``, ``--quantize-lm-head`` and ``--quantize-grid`` ask for, checked before
anything loads (``options.ExportOptions.check``). Each target applies it: ExecuTorch quantizes the module before export
(``executorch/quantize.py``), ONNX the saved graph's weights (``onnx/quantize.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from ..choices import EmbeddingScheme, Grid, LmHeadScheme, Scheme

# The export options that choose a quantization (ExportOptions' fields, and matrix rows' keys).
OPTIONS = ("quantize", "quantize_embedding", "quantize_lm_head", "quantize_grid")
# --quantize-embedding (ExecuTorch): kvexport's name -> ExecuTorch's quantize_model_ config.
EMBEDDING_SCHEMES = {EmbeddingScheme.INT8: "8w", EmbeddingScheme.INT4: "4w"}


@dataclass(frozen=True)
class Quantization:
    """What ``--quantize``, ``--quantize-embedding``, ``--quantize-lm-head`` and ``--quantize-grid``
    ask for (None: not asked), carried as one value from the command line to the target that applies it."""

    scheme: Scheme | None = None  # --quantize: the target's one scheme
    embedding: EmbeddingScheme | None = None  # --quantize-embedding (executorch)
    lm_head: LmHeadScheme | None = None  # --quantize-lm-head, with scheme [default: int8]
    grid: Grid | None = None  # --quantize-grid, with scheme [default: source]

    @property
    def symmetric(self) -> bool:
        """Every linear weight rounded to symmetric int4 (``--quantize-grid symmetric``)."""
        return self.grid == Grid.SYMMETRIC

    def __bool__(self) -> bool:  # whether anything is quantized (an lm_head scheme alone is refused)
        return bool(self.scheme or self.embedding)
