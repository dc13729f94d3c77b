"""Tiny random models, one per supported family, for tests and quick tries.

Each is a real transformers model built from a small config with seeded weights, so every run
builds the same model. Windows are a few tokens, so a short test already runs far past them. All
share a character-level tokenizer whose vocabulary is the model's (printable ASCII + specials).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: the CLI refuses a bad model name before torch loads
    import torch
    from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD, UNK = "<bos>", "<eos>", "<pad>", "<unk>"
SPECIALS = [BOS, EOS, PAD, UNK]
VOCAB_SIZE = 96 + len(SPECIALS)  # newline, printable ASCII, specials
WINDOW = 6
CHUNK = 8  # chunked attention's chunks (Llama 4)

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    # Two layers: every family's kinds of layer (sliding and full, rope and no-rope) meet in two, and a
    # tiny export's time grows with its layers; the real models cover depth.
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=96,
    eos_token_id=97,
    pad_token_id=98,
    # Larger than the usual 0.02: greedy choices then have clear margins and the text varies.
    initializer_range=0.5,
    # Untied: a tiny tied Gemma (embeddings scaled by sqrt(hidden)) just repeats its last input token.
    # tiny-smollm3 covers tied embeddings.
    tie_word_embeddings=False,
)

# name -> (model_type, config overrides). Sliding families get windows of WINDOW tokens.
PRESETS: dict[str, tuple[str, dict]] = {
    "tiny-llama": ("llama", {}),
    "tiny-mistral": ("mistral", {"sliding_window": WINDOW, "head_dim": 16}),
    "tiny-qwen2": ("qwen2", {}),
    "tiny-qwen3": ("qwen3", {"head_dim": 16}),
    "tiny-phi3": ("phi3", {"sliding_window": WINDOW}),
    "tiny-gemma2": (
        "gemma2",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "query_pre_attn_scalar": 16,
        },
    ),
    "tiny-gemma3": (
        "gemma3_text",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 16,
            "num_key_value_heads": 1,  # as Gemma 3 270M and 1B: their rings attend through XNNPACK's matmuls
            "initializer_range": 0.3,  # at 0.5 this one has near-ties on the test prompt
        },
    ),
    # Gemma 4 as its on-device models are built: full layers with a head size and KV-head count of
    # their own (keys and values from one projection there), the last layer of each type reading the
    # KV cache of an earlier one (four layers: each kind of layer meets each other), per-layer input
    # embeddings, a double-wide MLP in the sharing layers, and the MoE block beside the MLP.
    "tiny-gemma4": (
        "gemma4_text",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "num_hidden_layers": 4,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "global_head_dim": 32,
            "num_global_key_value_heads": 1,
            "attention_k_eq_v": True,
            "num_kv_shared_layers": 2,
            "hidden_size_per_layer_input": 8,
            "vocab_size_per_layer_input": VOCAB_SIZE,
            "use_double_wide_mlp": True,
            "enable_moe_block": True,
            "num_experts": 4,
            "top_k_experts": 2,
            "moe_intermediate_size": 32,
        },
    ),
    # Gemma 3n: the last layer of each type reading the KV cache of an earlier one (four layers, as
    # tiny-gemma4), whose sharing layers attend from every token of a call; per-layer input
    # embeddings, AltUp's four streams, LAuReL's low-rank residual and activation sparsity (a
    # Gaussian top-k of the gate) in the first layer, as the real ones have in their first ten.
    "tiny-gemma3n": (
        "gemma3n_text",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "num_hidden_layers": 4,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "num_kv_shared_layers": 2,
            "hidden_size_per_layer_input": 8,
            "vocab_size_per_layer_input": VOCAB_SIZE,
            "altup_num_inputs": 4,
            "laurel_rank": 8,
            "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
        },
    ),
    # LFM2: a short gated convolution (a state of conv_L_cache - 1 inputs) before an attention layer.
    "tiny-lfm2": ("lfm2", {"layer_types": ["conv", "full_attention"], "block_auto_adjust_ff_dim": False}),
    # Qwen 3.5: gated-delta linear attention (a convolution and a recurrent state) before a gated
    # full-attention layer, more value heads than key heads as in the real ones.
    "tiny-qwen3.5": (
        "qwen3_5_text",
        {
            "layer_types": ["linear_attention", "full_attention"],
            "head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
        },
    ),
    # Granite 4 hybrid: a Mamba-2 layer (a convolution and a state-space state, two groups of B and C)
    # before an attention layer with rope, mixture-of-experts MLPs.
    "tiny-granite4": (
        "granitemoehybrid",
        {
            "layer_types": ["linear_attention", "full_attention"],
            "mamba_n_heads": 4,
            "mamba_n_groups": 2,
            "mamba_d_state": 16,
            "mamba_d_head": 32,
            "mamba_chunk_size": 16,
            "position_embedding_type": "rope",
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    # Bamba, Granite 4 hybrid's parent: a Mamba-2 layer (two groups of B and C) before an attention
    # layer with rope on half of each head, dense MLPs.
    "tiny-bamba": (
        "bamba",
        {
            "attn_layer_indices": [1],
            "mamba_n_heads": 4,
            "mamba_n_groups": 2,
            "mamba_d_state": 16,
            "mamba_chunk_size": 16,
        },
    ),
    # Falcon-H1: every layer runs attention and a Mamba-2 mixer side by side (a KV cache and a state
    # in one layer), its mixer's inner channels set apart from the hidden size (mamba_d_ssm), with
    # the model's muP multipliers away from 1 so that one applied wrongly changes the logits.
    "tiny-falcon-h1": (
        "falcon_h1",
        {
            "mamba_d_ssm": 96,
            "mamba_n_heads": 4,
            "mamba_n_groups": 2,
            "mamba_d_state": 16,
            "mamba_chunk_size": 16,
            "embedding_multiplier": 1.5,
            "lm_head_multiplier": 0.7,
            "key_multiplier": 1.3,
            "attention_in_multiplier": 0.8,
            "attention_out_multiplier": 1.2,
            "ssm_in_multiplier": 1.1,
            "ssm_out_multiplier": 0.9,
            "ssm_multipliers": [0.9, 1.1, 1.2, 0.8, 1.3],
            "mlp_multipliers": [1.2, 0.9],
        },
    ),
    # Nemotron-H: one block of each kind it has, a Mamba-2 mixer (two groups of B and C; its step
    # clamped to time_step_min in transformers' chunked scan only), attention, a mixture of experts
    # with a shared expert, and an MLP; the last two hold no cache.
    "tiny-nemotron-h": (
        "nemotron_h",
        {
            "layers_block_type": ["linear_attention", "full_attention", "moe", "mlp"],
            "num_hidden_layers": 4,
            "head_dim": 16,
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "n_groups": 2,
            "ssm_state_size": 16,
            "chunk_size": 16,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "moe_shared_expert_intermediate_size": 32,
        },
    ),
    # Llama 4 text: a chunked-attention layer (chunks of CHUNK tokens) with rope, L2 qk-norm and the
    # mixture of experts, then a full-attention NoPE layer with a dense MLP whose queries get the
    # temperature tuning (a small floor_scale, so it changes within a short test).
    "tiny-llama4": (
        "llama4_text",
        {
            "head_dim": 16,
            "attention_chunk_size": CHUNK,
            "no_rope_layers": [1, 0],
            "moe_layers": [0],
            "num_local_experts": 4,
            "intermediate_size_mlp": 128,
            "floor_scale": 4,
            "attn_scale": 0.5,
        },
    ),
    "tiny-smollm3": ("smollm3", {"no_rope_layer_interval": 2, "tie_word_embeddings": True}),
    # Attention sinks, a mixture of experts (top 2 of 4) and alternating sliding / full layers.
    "tiny-gpt-oss": (
        "gpt_oss",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            # At 0.5 the first greedy choice after the tests' prompt is a near-tie that float
            # reordering flips; at 0.2 the margins are clear.
            "initializer_range": 0.2,
            # The family's YaRN rope, with an original context consistent with max_position_embeddings.
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
            },
        },
    ),
}


def is_preset(name: str) -> bool:
    return name in PRESETS


def preset_config(name: str):
    model_type, overrides = PRESETS[name]
    return tiny_config(model_type, overrides)


def tiny_config(model_type: str, overrides: dict):
    """A tiny config of any family: the shared tiny defaults (they fit the tokenizer), then ``overrides``.

    A default the family's config does not have is left out (the token ids aside): GPT-2's attention
    has no KV heads of its own, and a ``num_key_value_heads`` set on its config would tell kvexport's
    cache a shape its attention never computes."""
    from transformers import AutoConfig

    known = AutoConfig.for_model(model_type)
    common = {key: value for key, value in _COMMON.items() if key.endswith("_token_id") or hasattr(known, key)}
    return AutoConfig.for_model(model_type, **{**common, **overrides})


def build_preset(name: str, dtype: torch.dtype | str = "float32"):
    """The preset's model (eval mode, seeded weights) and its tokenizer."""
    return build_tiny(preset_config(name), dtype)


def build_tiny(config, dtype: torch.dtype | str = "float32"):
    """A tiny config's model (eval mode, seeded weights) and the character tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        # Drawn in float32, then rounded: float16 draws from one seed differ between torch versions,
        # and a check on another machine rebuilds the model.
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _redraw_zero_weights(model, config)
        model = model.to(dtype)
    text = config.get_text_config()  # a composite config (Fuyu) holds its token ids in its text config
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
        setattr(model.generation_config, name, getattr(config if hasattr(config, name) else text, name))
    return model.eval(), char_tokenizer()


def _redraw_zero_weights(model, config) -> None:
    """Random weights where the family's initialization leaves a matrix at zero (AFMoE's router):
    a zero router scores every expert the same, a tie that torch and ONNX Runtime break differently,
    which a trained router never has. Biases and vectors keep their initialization."""
    import torch

    std = getattr(config.get_text_config(), "initializer_range", None) or 0.02
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("weight") and param.dim() >= 2 and not param.any():
                param.normal_(0.0, std)


def char_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE over printable ASCII and newline, one token per character, ``<bos>`` prepended.

    Every token decodes to whole characters, so any generated sequence is valid text (runners that
    stream token by token, ExecuTorch's included, need that); other characters become ``<unk>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    to_unicode = {b: ch for b, ch in zip(range(256), _byte_level_alphabet())}
    chars = [to_unicode[b] for b in [10, *range(32, 127)]]
    vocab = {ch: i for i, ch in enumerate(chars)}
    for special in SPECIALS:
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        chat_template=(
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}"
        ),
    )


def _byte_level_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode table, in byte order (what ByteLevel pre-tokenization produces)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]
