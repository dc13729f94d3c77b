"""What a model's config says about its attention layers, and whether we can export it.

Everything the cache needs is read from the config: ``layer_types`` (``"full_attention"`` or
``"sliding_attention"``) where the family has it, else one kind for every layer, decided by
``sliding_window``. A family qualifies when it is a decoder-only causal LM whose layers are full,
sliding-window or chunked attention (or a state kvexport runs); what cannot work is refused here,
before any tracing.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedModelError

FULL = "full_attention"
SLIDING = "sliding_attention"
# Chunked attention (Llama 4): a token at position p attends to the earlier tokens of its own chunk,
# positions [floor(p / C) * C, p] for chunks of C (``attention_chunk_size``). Every such key is among
# the last C positions, so a ring of C slots holds them; the mask adds the chunk's start.
CHUNKED = "chunked_attention"
# A short gated convolution in place of attention (LFM2, LFM3): ``conv_L_cache`` taps over the
# sequence, its state the last ``conv_L_cache - 1`` inputs.
CONV = "conv"
# Linear attention (Qwen 3.5, Qwen3-Next): a gated delta rule behind a short causal convolution,
# whose state is one fixed-size matrix per value head, whatever the position.
LINEAR = "linear_attention"
# Attention and a Mamba-2 mixer side by side in one layer (Falcon-H1): a KV cache and a state.
HYBRID = "hybrid"
# A layer's cache kinds, as kvexport.json names them: a buffer of max_cache_len positions, a ring of
# the window's positions, none (the layer attends to an earlier layer's cache: KV sharing), a
# convolution's state, a linear-attention layer's convolution and recurrent states, or nothing (a
# layer that mixes no positions: Nemotron-H's MLP and MoE blocks).
STATIC, RING, SHARED, RECURRENT, NONE = "static", "ring", "shared", "recurrent", "none"
# Nemotron-H's layer types of blocks that mix no positions: they never touch the cache.
_NO_CACHE = ("mlp", "moe")
# The config attributes a linear-attention layer is built from: Qwen 3.5's gated delta rule, or a
# Mamba-2 state-space layer (Granite 4 hybrid names its layers linear_attention too).
_LINEAR_ATTENTION_SIZES = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                           "linear_value_head_dim", "linear_conv_kernel_dim")  # fmt: skip
_MAMBA2_SIZES = ("mamba_n_heads", "mamba_n_groups", "mamba_d_state", "mamba_d_head", "mamba_d_conv", "mamba_expand")
# Nemotron-H's names for them (its inner size is heads x head size, not an expansion of the hidden size).
_NEMOTRON_MAMBA2_SIZES = ("mamba_num_heads", "n_groups", "ssm_state_size", "mamba_head_dim", "conv_kernel")
# How a recurrent layer updates its state (kv_cache.GatedDeltaState, kv_cache.Mamba2State).
GATED_DELTA, MAMBA2 = "gated_delta", "mamba2"

# Families whose reason is worth naming precisely. Every other family is judged by the generic rules
# in check_supported, from what its config and transformers say about it.
_REFUSED = {
    "mamba": "a state-space model (no attention KV cache)",
    "mamba2": "a state-space model (no attention KV cache)",
    "rwkv": "a recurrent model (no attention KV cache)",
    "jamba": "a hybrid of attention and state-space layers",
    "zamba": "a hybrid of attention and state-space layers",
    "zamba2": "a hybrid of attention and state-space layers",
    "olmo_hybrid": "a hybrid whose linear-attention layers convolve queries, keys and values apart (kvexport "
    "runs Qwen 3.5's and Qwen3-Next's layout)",
    "recurrent_gemma": "a recurrent hybrid",
    "llama4": "a multimodal model (its text model, llama4_text, is supported)",
    "emu3": "a multimodal model (images as the tokens of its VQ tokenizer, vq_config); its text model, "
    "emu3_text_model, is no causal LM that AutoModelForCausalLM takes",
    "t5": "an encoder-decoder model",
    "bart": "an encoder-decoder model",
    "whisper": "an encoder-decoder speech model",
    "bert": "an encoder-only model",
    "diffllama": "a differential-attention model (each layer attends twice, over two halves of its values; a cache "
    "holds one call's keys and values)",
    "hrm_text": "a hierarchical reasoning model, which runs its layers several times per step (a cache holds one "
    "call's keys and values per layer)",
    "jetmoe": "a mixture of attention heads and of experts whose experts take as many tokens as the call routes "
    "to each (sizes from the call's values, which torch.export cannot trace)",
    "dbrx": "a mixture of experts that loops over the experts each call hits (control flow on the call's values, "
    "which torch.export cannot trace)",
}

# Sub-config names that mean the model takes more than text.
_MODALITIES = ("vision", "audio", "image", "video", "speech")


@dataclass(frozen=True)
class LayerSpec:
    """One layer as the cache sees it: attention (its KV shape), a convolution (its state), linear
    attention (its convolution's state and its recurrent state), or both attention and a Mamba-2
    mixer (Falcon-H1: its KV shape and the mixer's states)."""

    layer_type: str  # the key transformers uses for this layer's mask
    window: int | None  # sliding window (a chunked layer's: its chunk size), None for full attention
    kv_heads: int  # 0 for a layer that does not attend
    head_dim: int  # 0 for a layer that does not attend
    # KV sharing (Gemma 4, Gemma 3n): the earlier layer whose keys and values this layer attends to;
    # it computes none of its own and holds no cache.
    reads: int | None = None
    # Whether such a layer runs on every token of a call (Gemma 3n), not on the call's last token
    # only (Gemma 4, whose model slices its inputs: ``_maybe_slice_kv_shared_inputs``).
    reads_every_token: bool = False
    # A convolution's state: (channels, the inputs before the call that it looks back at).
    conv_state: tuple[int, int] | None = None
    # A recurrent layer's state, kept in float32, and its update rule: (value heads, key size, value
    # size) for the gated delta rule, (heads, head size, state size) for Mamba-2.
    recurrent_state: tuple[int, int, int] | None = None
    rule: str | None = None
    # Chunked attention: the chunk size C (``window`` is C too: the ring that holds a chunk's keys).
    chunk: int | None = None

    def cache_kind(self, max_cache_len: int) -> str:
        """The KV cache's kind where the layer attends (a hybrid layer's too), else its state's, else
        none (a layer that mixes no positions)."""
        if not self.has_kv:
            return self.state_kind or NONE
        if self.reads is not None:
            return SHARED
        return RING if self.is_ring(max_cache_len) else STATIC

    @property
    def state_kind(self) -> str | None:
        """The kind of the layer's state: a linear-attention (or Mamba-2) one, a convolution's, or none."""
        if self.recurrent_state is not None:
            return RECURRENT
        return CONV if self.conv_state is not None else None

    def cache_slots(self, max_cache_len: int) -> int:
        """Positions this layer's own cache holds: none for a shared layer, the window for a ring,
        a convolution's state, else the whole context."""
        if not self.has_kv:
            return self.conv_state[1] if self.conv_state else 0
        if self.reads is not None:
            return 0
        if self.window is not None and self.window < max_cache_len:
            return self.window
        return max_cache_len

    def is_ring(self, max_cache_len: int) -> bool:
        return self.reads is None and self.window is not None and self.window < max_cache_len

    @property
    def has_kv(self) -> bool:
        """Whether the layer attends (keys and values); a hybrid layer also holds a state."""
        return self.kv_heads > 0


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_supported(config) -> None:
    """Refuse, with the reason, a config whose model cannot become a cached decoder.

    Generic rules, so that a family nobody listed is judged by what its config says: transformers
    must load it as a causal LM, text in, whose attention goes through transformers'
    ``AttentionInterface`` (where kvexport's cache plugs in), causal, and made of full or
    sliding-window attention layers only.
    """
    model_type = getattr(config, "model_type", None)

    def refuse(reason: str):
        raise UnsupportedModelError(f"architecture '{model_type}' is not supported: {reason}")

    if model_type in _REFUSED:
        refuse(f"it is {_REFUSED[model_type]}")
    if getattr(config, "is_encoder_decoder", False):
        refuse("it is an encoder-decoder model")
    inputs = sorted(name for name in getattr(config, "sub_configs", None) or {} if any(m in name for m in _MODALITIES))
    if inputs:
        refuse(f"it is a multimodal model ({', '.join(inputs)}); kvexport exports text-only decoders")
    try:
        text = text_config(config)
    except ValueError as e:  # several candidate text configs
        refuse(f"its text model is ambiguous ({e})")
    if text.model_type in _REFUSED:
        refuse(f"it is {_REFUSED[text.model_type]}")
    causal_lm = _causal_lm_class(model_type)
    if causal_lm is None:
        refuse("transformers has no causal-LM class for it (AutoModelForCausalLM does not take it)")
    # Hybrids with recurrent layers (Qwen 3.5, Bamba) do not declare it, because of those layers; for
    # them transformers' own test decides: whether the module's attention classes call the interface.
    if _recurrent_rule(text):
        routes = causal_lm._can_set_attn_implementation()
    else:
        routes = getattr(causal_lm, "_supports_attention_backend", False)
    if not routes:
        refuse(
            f"{causal_lm.__name__} does not route its attention through transformers' AttentionInterface, "
            "which kvexport's cache plugs into"
        )
    # BERT-style encoders that transformers can also run as decoders declare both settings; with
    # is_decoder false their attention is bidirectional. (GPT-NeoX declares is_decoder alone, unused.)
    if getattr(text, "is_decoder", None) is False and getattr(text, "add_cross_attention", None) is not None:
        refuse("it is an encoder (is_decoder is false: bidirectional attention)")
    if getattr(text, "use_bidirectional_attention", False):
        refuse("it is configured for bidirectional attention")
    if _in_any_layer(text, "kv_lora_rank"):
        refuse(
            "its attention is multi-head latent attention (kv_lora_rank: DeepSeek-V2/V3 style), whose cache holds "
            "a latent that the keys and values are expanded from; kvexport caches keys and values"
        )
    values = getattr(text, "v_head_dim", None)
    keys = _kv_shape(text, 0)[1] if values else None
    if values and values != keys:
        refuse(f"its values have a head size of their own (v_head_dim {values}, keys {keys}); kvexport's caches "
               "hold keys and values of one size")
    for layer_type in sorted(set(getattr(text, "layer_types", None) or ())):
        if layer_type == CONV and getattr(text, "conv_L_cache", None):
            continue  # LFM2's short convolution (models/adapters.py runs it over kvexport's state)
        if layer_type == LINEAR and _recurrent_rule(text):
            continue  # a gated delta rule or Mamba-2 (models/adapters.py runs it over kvexport's state)
        if layer_type == HYBRID and _recurrent_rule(text) == MAMBA2:
            continue  # Falcon-H1: attention and a Mamba-2 mixer in one layer, a KV cache and a state
        if layer_type == CHUNKED and getattr(text, "attention_chunk_size", None):
            continue  # Llama 4's chunked attention: a ring of the chunk's size
        if layer_type in _NO_CACHE and text.model_type == "nemotron_h":
            continue  # Nemotron-H's MLP and MoE blocks: nothing to cache
        if layer_type not in (FULL, SLIDING):
            refuse(
                f"it has '{layer_type}' layers; only full, sliding-window and chunked attention layers, short "
                "convolutions and gated-delta linear attention are supported"
            )
    if set(getattr(text, "layer_types", None) or ()) == {LINEAR}:
        refuse(
            "none of its layers attends (all linear attention or Mamba-2): transformers' own cached generation "
            "of such a model fails, so there is no eager generation to export it against"
        )
    try:
        heads = getattr(text, "num_attention_heads", None)
    except Exception as e:  # transformers refuses a global read of a per-layer attribute
        refuse(f"its layers differ in their number of query heads ({type(e).__name__})")
    if not heads:
        refuse("it has no attention heads (a state-space or recurrent model)")


def _recurrent_rule(config) -> str | None:
    """How the config's linear-attention layers are built, where kvexport runs them: Qwen 3.5's gated
    delta rule, or Mamba-2 (Granite 4 hybrid, Bamba, Falcon-H1's hybrid layers, Nemotron-H); None
    without such layers or for another kind."""
    if not {LINEAR, HYBRID} & set(getattr(config, "layer_types", None) or ()):
        return None
    if all(getattr(config, name, None) for name in _LINEAR_ATTENTION_SIZES):
        return GATED_DELTA
    if all(getattr(config, name, None) for name in _NEMOTRON_MAMBA2_SIZES):
        # Its mixers clamp the step to time_step_min where transformers' chunked scan runs and not in
        # its 1-token update: models/adapters.py follows the same choice (_mamba2_step).
        return MAMBA2
    if all(getattr(config, name, None) for name in _MAMBA2_SIZES):
        limit = getattr(config, "time_step_limit", None)
        if limit is not None and tuple(limit) != (0.0, float("inf")):
            # transformers clamps the step in its chunked scan (prefill) but not in its 1-token update.
            raise UnsupportedModelError(
                f"architecture '{config.model_type}' is not supported: its time_step_limit {tuple(limit)} clamps "
                "transformers' prefill steps and not its decode steps, which one program cannot follow"
            )
        return MAMBA2
    return None


def prompt_in_one_call(config) -> bool:
    """Whether a prompt must reach the program in one call: Nemotron-H's Mamba-2 mixers clamp the step
    to time_step_min in transformers' chunked scan and not in its 1-token update, and eager generation
    prefills the whole prompt in one scan. A prompt split into calls can end in a call of one token,
    which the program (choosing per call as transformers does) would take as an update."""
    return text_config(config).model_type == "nemotron_h"


def _in_any_layer(config, name: str) -> bool:
    """Whether the config sets ``name``, for the model or (``per_layer_config``) for any layer."""
    if getattr(config, "is_heterogeneous", False) and name in config.per_layer_attributes:
        return any(getattr(layer, name, None) for layer in config.per_layer_config)
    return bool(getattr(config, name, None))


def rope_parameters(config) -> list[dict]:
    """The text model's rotary-embedding parameters: one dict, or one per layer type where the config
    nests them (Gemma 3's global and local layers)."""
    params = getattr(text_config(config), "rope_parameters", None) or {}
    if isinstance(params.get("rope_type", params.get("type")), str):
        return [params]
    return [p for p in params.values() if isinstance(p, dict)]


def check_rope(config, max_cache_len: int) -> None:
    """Refuse a rotary embedding whose rotation eager transformers changes with the sequence's length
    within ``max_cache_len`` positions: one program with a KV cache rotates every position one way.

    transformers fixes the frequencies when the model is built for every rope type but two, which
    ``dynamic_rope_update`` recomputes at each forward call from ``max(position_ids) + 1``:
    ``dynamic`` (NTK) rescales them only past ``max_position_embeddings``, which an export never
    reaches (``--max-cache-len`` is at most that); ``longrope`` switches every position of the call
    from its short factors to its long ones past ``original_max_position_embeddings``, and Phi-3's
    generation then recomputes the whole cache with them. Within that length it is the short factors
    throughout, exactly; past it no program can follow, so a longer cache is refused here.
    """
    for rope_type, bound in _rope_bounds(config):
        if max_cache_len <= bound:
            continue
        if rope_type == "longrope":
            raise UnsupportedModelError(
                f"rope type 'longrope' cannot be exported exactly with a cache of {max_cache_len} positions: past "
                f"original_max_position_embeddings ({bound}) transformers switches every position, cached ones "
                f"included, from the short to the long factors, which one program with a KV cache cannot; "
                f"export with --max-cache-len {bound} or less"
            )
        raise UnsupportedModelError(
            f"rope type '{rope_type}' cannot be exported exactly with a cache of {max_cache_len} positions: past "
            f"max_position_embeddings ({bound}) transformers rescales every position's frequencies with the "
            f"length, which one program cannot; export with --max-cache-len {bound} or less"
        )


def exact_rope_positions(config) -> int | None:
    """The most positions ``check_rope`` lets a cache hold (None: no rope type limits it)."""
    return min((bound for _, bound in _rope_bounds(config)), default=None)


def _rope_bounds(config):
    """``(rope type, positions)`` for each rope type whose rotation transformers changes past a length:
    longrope past ``original_max_position_embeddings``, the dynamic types past ``max_position_embeddings``."""
    limit = getattr(text_config(config), "max_position_embeddings", None)
    for params in rope_parameters(config):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "longrope":
            bound = params.get("original_max_position_embeddings") or limit
        elif "dynamic" in rope_type:
            bound = limit
        else:
            continue
        if bound:
            yield rope_type, bound


def _slices_kv_shared_layers(model_type: str) -> bool:
    """Whether transformers' base model of ``model_type`` runs its KV-sharing layers on the call's last
    token only (``_maybe_slice_kv_shared_inputs``, Gemma 4), rather than on every token (Gemma 3n)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    name = MODEL_MAPPING_NAMES.get(model_type)
    return hasattr(getattr(transformers, name, None) if isinstance(name, str) else None, "_maybe_slice_kv_shared_inputs")


def _causal_lm_class(model_type: str | None):
    """The class AutoModelForCausalLM builds for ``model_type``, or None."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return getattr(transformers, name, None) if isinstance(name, str) else None


def layer_specs(config) -> list[LayerSpec]:
    """Per-layer attention kind, window, KV shape and KV sharing, from the config alone."""
    check_supported(config)
    config = text_config(config)
    n_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        layer_types = [SLIDING if window else FULL] * n_layers
    reads = _kv_shared_layers(config, layer_types[:n_layers])
    every_token = bool(reads) and not _slices_kv_shared_layers(config.model_type)
    specs = []
    for i, layer_type in enumerate(layer_types[:n_layers]):
        if layer_type in _NO_CACHE:
            specs.append(LayerSpec(layer_type, None, 0, 0))
            continue
        if layer_type == CONV:
            specs.append(LayerSpec(CONV, None, 0, 0, conv_state=(config.hidden_size, config.conv_L_cache - 1)))
            continue
        if layer_type == LINEAR:
            specs.append(_linear_attention(config) if _recurrent_rule(config) == GATED_DELTA else _mamba2(config))
            continue
        if layer_type == SLIDING and not window:
            raise UnsupportedModelError("the config has sliding-attention layers but no sliding_window")
        kv_heads, head_dim = _kv_shape(config, i)
        if layer_type == HYBRID:
            # Its attention is full attention (transformers masks it with the full_attention mask).
            mixer = _mamba2(config)
            specs.append(LayerSpec(FULL, None, kv_heads, head_dim, conv_state=mixer.conv_state,
                                   recurrent_state=mixer.recurrent_state, rule=MAMBA2))  # fmt: skip
            continue
        if layer_type == CHUNKED:
            chunk = config.attention_chunk_size
            specs.append(LayerSpec(CHUNKED, chunk, kv_heads, head_dim, reads.get(i), chunk=chunk))
            continue
        sliding_window = window if layer_type == SLIDING else None
        specs.append(LayerSpec(layer_type, sliding_window, kv_heads, head_dim, reads.get(i), i in reads and every_token))
    for i, j in reads.items():
        if not specs[j].has_kv or (specs[i].kv_heads, specs[i].head_dim) != (specs[j].kv_heads, specs[j].head_dim):
            raise UnsupportedModelError(f"layer {i} reads the KV cache of layer {j}, whose keys have another shape")
        if specs[j].chunk:  # a shared read masks by the window alone (kv_cache.shared_ring_mask)
            raise UnsupportedModelError(f"layer {i} reads the KV cache of layer {j}, a chunked-attention layer")
    return specs


def _linear_attention(config) -> LayerSpec:
    """A gated delta rule's states: its convolution over the concatenated queries, keys and values,
    and one ``key size x value size`` matrix per value head."""
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    return LayerSpec(
        LINEAR, None, 0, 0,
        conv_state=(2 * key_dim + value_dim, config.linear_conv_kernel_dim - 1),
        recurrent_state=(config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim),
        rule=GATED_DELTA,
    )  # fmt: skip


def _mamba2(config) -> LayerSpec:
    """A Mamba-2 layer's states: its convolution over the inner channels and B, C of every group, and
    one ``head size x state size`` matrix per head. The inner channels are Nemotron-H's heads times
    head size, ``mamba_d_ssm`` where the config sets it (Falcon-H1), else ``mamba_expand`` times
    the hidden size."""
    if all(getattr(config, name, None) for name in _NEMOTRON_MAMBA2_SIZES):
        heads, head, groups, size = config.mamba_num_heads, config.mamba_head_dim, config.n_groups, config.ssm_state_size
        inner, width = heads * head, config.conv_kernel
    else:
        heads, head, groups, size = config.mamba_n_heads, config.mamba_d_head, config.mamba_n_groups, config.mamba_d_state
        inner = getattr(config, "mamba_d_ssm", None) or int(config.mamba_expand * config.hidden_size)
        width = config.mamba_d_conv
    return LayerSpec(
        LINEAR, None, 0, 0,
        conv_state=(inner + 2 * groups * size, width - 1),
        recurrent_state=(heads, head, size),
        rule=MAMBA2,
    )  # fmt: skip


def _kv_shape(config, index: int) -> tuple[int, int]:
    """Layer ``index``'s KV heads and head size: its own where the config gives layers their own
    (``per_layer_config``: Gemma 4's full-attention layers), else the model's."""
    layer = config.per_layer_config[index] if getattr(config, "is_heterogeneous", False) else config
    heads = config.num_attention_heads
    kv_heads = getattr(layer, "num_key_value_heads", None) or heads
    head_dim = getattr(layer, "head_dim", None) or config.hidden_size // heads
    return kv_heads, head_dim


def _kv_shared_layers(config, layer_types: list[str]) -> dict[int, int]:
    """``{consumer: producer}`` for KV sharing as transformers declares it (``kv_sharing_modes``:
    ``"reuse"`` layers read what the ``"store"`` layer of their type computed), else nothing."""
    try:
        modes = getattr(config, "kv_sharing_modes", None) or []
    except ValueError as e:  # a consumer type no earlier layer produces
        raise UnsupportedModelError(f"its KV sharing is inconsistent ({e})")
    producers = {layer_types[i]: i for i, mode in enumerate(modes) if mode == "store"}
    reads = {}
    for i, mode in enumerate(modes):
        if mode == "reuse":
            if layer_types[i] not in producers:
                raise UnsupportedModelError(f"layer {i} shares a KV cache that no earlier '{layer_types[i]}' layer stores")
            reads[i] = producers[layer_types[i]]
    return reads

