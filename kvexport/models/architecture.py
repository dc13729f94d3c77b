"""What a model's config says about its attention layers, and whether we can export it.

Everything the cache needs is read from the config: ``layer_types`` (``"full_attention"`` or
``"sliding_attention"``) where the family has it, else one kind for every layer, decided by
``sliding_window``. A family qualifies when it is a decoder-only causal LM whose layers are all
full or sliding-window attention; what cannot work is refused here, before any tracing.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedModelError

FULL = "full_attention"
SLIDING = "sliding_attention"

# Families exercised by the tests; others that follow the same structure are tried, not refused.
TESTED_FAMILIES = ("llama", "mistral", "qwen3", "gemma3_text")

# Families known not to fit a decoder-only, attention-only KV cache, with the reason.
_REFUSED = {
    "mamba": "a state-space model (no attention KV cache)",
    "mamba2": "a state-space model (no attention KV cache)",
    "rwkv": "a recurrent model (no attention KV cache)",
    "jamba": "a hybrid of attention and state-space layers",
    "zamba": "a hybrid of attention and state-space layers",
    "zamba2": "a hybrid of attention and state-space layers",
    "falcon_h1": "a hybrid of attention and state-space layers",
    "bamba": "a hybrid of attention and state-space layers",
    "granitemoehybrid": "a hybrid of attention and state-space layers",
    "lfm2": "a hybrid of attention and convolution layers",
    "qwen3_next": "a hybrid of attention and linear-attention layers",
    "recurrent_gemma": "a recurrent hybrid",
    "gemma3n": "a multimodal model with shared KV layers",
    "llama4": "chunked attention and multimodal inputs",
    "t5": "an encoder-decoder model",
    "bart": "an encoder-decoder model",
    "whisper": "an encoder-decoder speech model",
    "bert": "an encoder-only model",
}


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer as the cache sees it."""

    layer_type: str  # the key transformers uses for this layer's mask
    window: int | None  # sliding window, None for full attention
    kv_heads: int
    head_dim: int

    def cache_slots(self, max_cache_len: int) -> int:
        """Positions this layer holds: the window for a ring, else the whole context."""
        if self.window is not None and self.window < max_cache_len:
            return self.window
        return max_cache_len

    def is_ring(self, max_cache_len: int) -> bool:
        return self.window is not None and self.window < max_cache_len


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_supported(config) -> None:
    """Refuse, with the reason, a config whose model cannot become a cached decoder."""
    config = text_config(config)
    model_type = getattr(config, "model_type", None)
    if model_type in _REFUSED:
        raise UnsupportedModelError(f"architecture '{model_type}' is not supported: it is {_REFUSED[model_type]}")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"architecture '{model_type}' is not supported: it is an encoder-decoder model")
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(f"architecture '{model_type}' is configured for bidirectional attention")
    for layer_type in set(getattr(config, "layer_types", None) or ()):
        if layer_type not in (FULL, SLIDING):
            raise UnsupportedModelError(
                f"architecture '{model_type}' has '{layer_type}' layers; only full and sliding-window "
                "attention layers are supported"
            )


def layer_specs(config) -> list[LayerSpec]:
    """Per-layer attention kind, window and KV shape, from the config alone."""
    config = text_config(config)
    check_supported(config)
    n_layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        layer_types = [SLIDING if window else FULL] * n_layers
    specs = []
    for layer_type in layer_types[:n_layers]:
        if layer_type == SLIDING and not window:
            raise UnsupportedModelError("the config has sliding-attention layers but no sliding_window")
        specs.append(LayerSpec(layer_type, window if layer_type == SLIDING else None, kv_heads, head_dim))
    return specs


def kv_cache_bytes(specs: list[LayerSpec], max_cache_len: int, dtype_bytes: int, batch: int = 1) -> int:
    """Bytes of K and V held by all layers."""
    return sum(2 * batch * s.kv_heads * s.cache_slots(max_cache_len) * s.head_dim * dtype_bytes for s in specs)
