"""kvexport's attention, registered with transformers' ``AttentionInterface``.

transformers calls it instead of its own attention, with the layer's new keys and values. They go
to the layer's cache: a cache with its own kernel writes them and attends (``attend``); any other
returns the keys to attend to (``update``) and the model's own eager attention runs on them, so
per-family details (soft-capping, sinks, scaling) stay transformers'.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask
from transformers.models.llama import modeling_llama

NAME = "kvexport"
# The call the decoder is running, for layers whose model does not hand transformers' call arguments
# on to their attention (Nemotron's decoder layers drop them): they reach it here.
_running_call = None


@contextmanager
def running(call):
    """While the decoder runs the model on ``call``: every attention call belongs to it."""
    global _running_call
    before, _running_call = _running_call, call
    try:
        yield
    finally:
        _running_call = before


def family_eager_attention(module):
    """The ``eager_attention_forward`` of the module's own modeling file (they differ per family)."""
    return getattr(sys.modules[type(module).__module__], "eager_attention_forward", modeling_llama.eager_attention_forward)


def plain_softmax_attention(kwargs: dict) -> bool:
    """Whether the family's attention is softmax(QK^T·scale + mask)·V, what fused kernels compute
    (no soft-capping, no attention sinks, no dropout)."""
    return kwargs.get("softcap") is None and kwargs.get("s_aux") is None and not kwargs.get("dropout")


def kvexport_attention(module, query, key, value, attention_mask, kvexport_call=None, **kwargs):
    kvexport_call = kvexport_call or _running_call
    if kvexport_call is None:  # called by plain transformers (e.g. generate): its own cache ran already
        return family_eager_attention(module)(module, query, key, value, attention_mask, **kwargs)
    kvexport_call.reach(module, key, value)
    layer = kvexport_call.layers[module.layer_idx]
    attend = getattr(layer, "attend", None)
    if attend is not None:
        return attend(module, query, key, value, attention_mask, kvexport_call, **kwargs)
    keys, values = layer.update(kvexport_call.positions, key, value)
    kvexport_call.attended[layer] = keys, values  # for layers that share this one's cache
    return family_eager_attention(module)(module, query, keys, values, attention_mask, **kwargs)


AttentionInterface.register(NAME, kvexport_attention)
# When transformers drives the model itself, it builds the masks eager attention expects.
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, eager_mask)
