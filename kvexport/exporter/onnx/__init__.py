"""ONNX target (``target.py``): an ONNX graph with external data for ONNX Runtime and
onnxruntime-genai. What it accepts of the export options is declared here, without torch: a
request is checked before anything loads."""

from ...choices import Dtype, KvCache, Scheme
from ..options import Accepts

ACCEPTS = Accepts(
    dtypes=(Dtype.FLOAT32, Dtype.FLOAT16, Dtype.BFLOAT16),
    # ONNX Runtime's CPU provider has no bfloat16 MatMul: a bfloat16 graph runs on CUDA only.
    gpu_dtypes=(Dtype.BFLOAT16,),
    quantize=Scheme.INT4,
    quantize_embedding=False,  # --quantize int4 quantizes the embedding too
    # int8: fixed scales per KV head and channel, calibrated at export.
    kv_caches=(KvCache.FLOAT, KvCache.INT8),
)
