"""ExecuTorch target (``target.py``): an XNNPACK-delegated ``model.pte``. What it accepts of the
export options is declared here, without torch: a request is checked before anything loads."""

from ...choices import Dtype, KvCache, Scheme
from ..options import Accepts

ACCEPTS = Accepts(
    dtypes=(Dtype.FLOAT32, Dtype.FLOAT16, Dtype.BFLOAT16),
    quantize=Scheme.INT8_DYNAMIC_INT4,
    quantize_embedding=True,
    # int8: a scale and zero point per row, quantized as it is written (nothing runs at export).
    kv_caches=(KvCache.FLOAT, KvCache.INT8),
    sdpa_query=True,
    int8_kv_sdpa=True,
    decode_attention=True,
)
