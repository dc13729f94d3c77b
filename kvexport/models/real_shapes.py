"""Models at a published configuration's shapes, with random weights, for measuring what an export
of that size costs (time, memory, cache bytes, decode speed): exactness needs trained weights only
for near-ties, memory and time do not. The tokenizer is the tiny presets' character tokenizer (its
ids are within every vocabulary). A matrix's ``[models.NAME]`` table with ``shape = "..."`` builds
one (``matrices/scale.toml``); from the shell:

    python -m kvexport.models.real_shapes qwen3.5-0.8b build/qwen3.5-0.8b-random
    python -m kvexport.models.real_shapes llama3.1-8b build/llama3.1-8b-config --config-only
    python -m kvexport.models.real_shapes llama3.1-8b build/llama3.1-8b-random --streamed
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import InvalidOptionError


def _llama3(hidden: int, intermediate: int, layers: int, heads: int, head_dim: int, tied: bool, rope_factor: float):
    """A Llama 3.x config (8 KV heads, llama3 rope scaling from 8,192 positions)."""
    return ("llama", {
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": 8, "head_dim": head_dim, "vocab_size": 128256,
        "tie_word_embeddings": tied, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": rope_factor, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    })  # fmt: skip


# name -> (model_type, config): the published text config's shapes.
SHAPES = {
    # Qwen/Qwen3.5-0.8B's text model (as ExecuTorch's examples/models/qwen3_5/config/0_8b_config.json
    # gives it): 18 gated-delta layers and 6 gated full-attention layers.
    "qwen3.5-0.8b": ("qwen3_5_text", {
        "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 24, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 248320, "tie_word_embeddings": True,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 16,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        "max_position_embeddings": 262144,
    }),  # fmt: skip
    # google/gemma-4-E2B's text config: 35 layers, four sliding (window 512, head size 256) to one full
    # (head size 512, a quarter of it rotated); the last 20 layers read the last earlier layer's cache
    # of their kind; per-layer inputs of 256; double-wide MLPs in the shared layers.
    "gemma4-e2b": ("gemma4_text", {
        "hidden_size": 1536, "intermediate_size": 6144, "num_hidden_layers": 35, "num_attention_heads": 8,
        "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512, "vocab_size": 262144,
        "vocab_size_per_layer_input": 262144, "hidden_size_per_layer_input": 256, "num_kv_shared_layers": 20,
        "use_double_wide_mlp": True, "sliding_window": 512, "final_logit_softcapping": 30.0,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "layer_types": [("full_attention" if (i + 1) % 5 == 0 else "sliding_attention") for i in range(35)],
        "rope_parameters": {
            "full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    }),  # fmt: skip
    # meta-llama's Llama-3.2-1B, Llama-3.2-3B and Llama-3.1-8B configs (the 8B's lm_head apart from
    # its embedding).
    "llama3.2-1b": _llama3(2048, 8192, 16, 32, 64, tied=True, rope_factor=32.0),
    "llama3.2-3b": _llama3(3072, 8192, 28, 24, 128, tied=True, rope_factor=32.0),
    "llama3.1-8b": _llama3(4096, 14336, 32, 32, 128, tied=False, rope_factor=8.0),
    # google/gemma-3-1b-it's config: five sliding layers (window 512) to one full.
    "gemma3-1b": ("gemma3_text", {
        "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144, "sliding_window": 512,
        "query_pre_attn_scalar": 256, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "layer_types": [("full_attention" if (i + 1) % 6 == 0 else "sliding_attention") for i in range(26)],
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    }),  # fmt: skip
    # Qwen/Qwen3-1.7B's config.
    "qwen3-1.7b": ("qwen3", {
        "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    }),  # fmt: skip
    # google/gemma-3-4b-it's text config: five sliding layers (window 1024) to one full, whose rope is
    # scaled linearly by 8.
    "gemma3-4b": ("gemma3_text", {
        "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 262208, "sliding_window": 1024,
        "query_pre_attn_scalar": 256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
        "layer_types": [("full_attention" if (i + 1) % 6 == 0 else "sliding_attention") for i in range(34)],
        "rope_parameters": {"full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    }),  # fmt: skip
    # microsoft/Phi-4-mini-instruct's shapes: 24 query heads of 128 over 8 KV heads, three quarters
    # of each head rotated (longrope, whose factors here are 1.0: the shapes do not depend on them).
    "phi4-mini": ("phi3", {
        "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 24,
        "num_key_value_heads": 8, "vocab_size": 200064, "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "sliding_window": 262144,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                            "short_factor": [1.0] * 48, "long_factor": [1.0] * 48},
    }),  # fmt: skip
}


def shape_config(name: str, overrides: dict | None = None):
    """The transformers config of shape ``name``, with ``overrides`` (e.g. fewer layers) on top."""
    from transformers import AutoConfig

    if name not in SHAPES:
        raise InvalidOptionError(f"unknown shape '{name}'; choose one of: {', '.join(sorted(SHAPES))}")
    model_type, shape = SHAPES[name]
    return AutoConfig.for_model(model_type, **{**shape, **(overrides or {})})


def write_model(config, out: Path, streamed: bool = True, config_only: bool = False) -> int:
    """A model folder of ``config`` at random bfloat16 weights (as checkpoints ship) and the character
    tokenizer; ``streamed`` writes a tensor at a time (``write_streamed``), else transformers builds
    and initializes the whole model; ``config_only`` writes no weights (enough for an export's memory
    plan). Returns the parameters' count (0 for ``config_only``)."""
    import torch
    from transformers import AutoModelForCausalLM

    from .presets import char_tokenizer

    if config_only:
        config.dtype = torch.bfloat16  # as the checkpoint would be
        config.save_pretrained(out)
        params = 0
    elif streamed:
        torch.manual_seed(0)
        params = write_streamed(config, out)
    else:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(out)
        params = sum(p.numel() for p in model.parameters())
    char_tokenizer().save_pretrained(out)
    return params


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvexport.models.real_shapes", description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--config-only", action="store_true",
                        help="write the config and tokenizer, no weights: enough for an export's memory plan")
    parser.add_argument("--streamed", action="store_true",
                        help="write the weights a tensor at a time (for models whose bfloat16 weights the machine cannot hold)")
    parser.add_argument("--overrides", type=json.loads, default=None,
                        help='config keys over the shape\'s, as JSON (e.g. \'{"num_hidden_layers": 2}\')')
    args = parser.parse_args(argv)
    config = shape_config(args.shape, args.overrides)
    params = write_model(config, args.out, streamed=args.streamed, config_only=args.config_only)
    what = "config and tokenizer only" if args.config_only else f"{params / 1e9:.2f}B parameters (random, bfloat16)"
    print(f"wrote {args.out}: {config.model_type}, {what}")


# A shard of the streamed checkpoint holds about this many bytes.
SHARD_BYTES = 2 * 2**30
# Rows of a matrix drawn at once.
DRAW_ROWS = 16384


def write_streamed(config, out: Path) -> int:
    """The checkpoint written a tensor at a time, in shards, never the whole model in memory (an 8B
    model's bfloat16 weights are 16 GB): the model is built on the meta device for its names and
    shapes; matrices are normal(0, initializer_range), vectors ones (norm scales) or zeros (biases),
    saved buffers (Gemma 4's layer scalars) ones. Not transformers' own initialization, which needs
    the whole model built. Returns the parameters' count."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    config.dtype = torch.bfloat16
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    std = getattr(config, "initializer_range", 0.02)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[tuple[str, list[str]]] = []
    shard: dict = {}
    written = {"bytes": 0, "parameters": 0}

    def add(name: str, value) -> None:
        shard[name] = value
        written["bytes"] += value.numel() * value.element_size()
        if sum(v.numel() * v.element_size() for v in shard.values()) >= SHARD_BYTES:
            flush()

    def flush() -> None:
        if shard:
            name = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            shards.append((name, list(shard)))
            shard.clear()

    for name, param in model.named_parameters():  # a tied weight once
        if param.dim() >= 2:  # drawn a piece of rows at a time: never a float32 copy of a whole table
            value = torch.empty(param.shape, dtype=torch.bfloat16)
            for rows in value.split(DRAW_ROWS):
                rows.copy_(torch.empty(rows.shape, dtype=torch.float32).normal_(0.0, std))
        else:
            value = (torch.ones if "norm" in name else torch.zeros)(param.shape, dtype=torch.bfloat16)
        written["parameters"] += value.numel()
        add(name, value)
    saved = set(model.state_dict())
    for name, buffer in model.named_buffers():
        if name in saved:
            add(name, torch.ones(buffer.shape, dtype=buffer.dtype))
    flush()
    weight_map = {}
    for n, (name, keys) in enumerate(shards, 1):
        final = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        (out / name).rename(out / final)
        weight_map.update(dict.fromkeys(keys, final))
    index = {"metadata": {"total_size": written["bytes"]}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config.save_pretrained(out)
    return written["parameters"]


if __name__ == "__main__":
    main()
