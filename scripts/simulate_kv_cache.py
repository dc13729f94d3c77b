"""What an int8 KV cache's rounding alone costs, simulated in eager transformers: the model's keys and
values are rounded as each target's cache stores them (``executorch``: ExecuTorch's per-row scales
after the key rotation, the query rounded too, as its kernel does; ``onnx``: the fixed per-channel
scales the ONNX export calibrates; ``bfloat16``/``float16``: the cache in that dtype; ``float``: none,
the harness's own check), and the model is teacher-forced on the prompt followed by eager's own greedy
continuation, as ``kvexport check --prompt`` feeds an artifact. No export is made, so a scheme or a
calibration rule can be compared in seconds (docs/quantization.md#int8-kv-cache).

Per scheme: top-1 agreement with eager over the continuation's steps (``check``'s figure) and eager's
margin where they differ; over every position of the sequence, top-1 agreement with the unrounded pass
and the mean KL divergence from it (a smoother figure than a count of a few near-ties).

    python scripts/simulate_kv_cache.py MODEL PROMPT_FILE [--schemes executorch onnx ...] [--steps 256]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # this checkout's kvexport

SCHEMES = ("float", "executorch", "onnx", "bfloat16", "float16")


def executorch_rounding(head_dim: int):
    from kvexport.exporter.executorch.quantized_kv_cache import dequantize_rows, key_rotation, quantize_rows

    rotation = key_rotation(head_dim)

    def rows(x):
        values, scales, zero_points = quantize_rows(x.reshape(-1, x.shape[-1]))
        return dequantize_rows(values, scales, zero_points, x.dtype).reshape(x.shape)

    return lambda layer, q, k, v: (rows(q @ rotation), rows(k @ rotation), rows(v))


def onnx_rounding(name: str, max_cache_len: int):
    """The ONNX export's own calibration, on a second copy of the model (the export's decoder wraps
    the model it is given)."""
    from kvexport.exporter.kv_calibration import calibration_ids
    from kvexport.exporter.onnx.attention import dequantize_from_cache, quantize_to_cache
    from kvexport.exporter.onnx.decoder import ExternalCacheDecoder
    from kvexport.exporter.onnx.quantized_kv_cache import calibrate
    from kvexport.models.sources import load_model, resolve

    model, tokenizer = load_model(resolve(name))
    scales = calibrate(ExternalCacheDecoder(model, max_cache_len), calibration_ids(tokenizer))

    def fixed(x, scale):  # [1, kv_heads, T, D] as GroupQueryAttention stores and reads it
        return dequantize_from_cache(quantize_to_cache(x[0], scale), scale)[None].to(x.dtype)

    return lambda layer, q, k, v: (q, fixed(k, scales[layer][0]), fixed(v, scales[layer][1]))


def cast_rounding(dtype):
    return lambda layer, q, k, v: (q, k.to(dtype).to(q.dtype), v.to(dtype).to(q.dtype))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="alias, preset, folder or .gguf, loaded in float32")
    parser.add_argument("prompt", type=Path, help="text file (trailing newlines dropped, as \"$(cat FILE)\" does)")
    parser.add_argument("--schemes", nargs="+", choices=SCHEMES, default=["executorch", "onnx"])
    parser.add_argument("--steps", type=int, default=256, help="greedy steps after the prompt")
    parser.add_argument("--max-cache-len", type=int, default=8192, help="the cache the onnx scales are calibrated for")
    args = parser.parse_args(argv)

    import torch
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from kvexport.checker.eager import greedy_generate
    from kvexport.models.sources import load_model, resolve

    model, tokenizer = load_model(resolve(args.model))
    prompt_ids = tokenizer(args.prompt.read_text().rstrip("\n"))["input_ids"]
    greedy = greedy_generate(model, prompt_ids, args.steps)
    sequence = torch.tensor([prompt_ids + greedy[:-1]])
    rounding = {"fn": None}

    def attention(module, query, key, value, attention_mask, **kwargs):
        if rounding["fn"] is not None:
            query, key, value = rounding["fn"](module.layer_idx, query, key, value)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("kv_rounding", attention)
    AttentionMaskInterface.register("kv_rounding", sdpa_mask)
    model.set_attn_implementation("kv_rounding")
    config = model.config.get_text_config()

    @torch.no_grad()
    def log_probs():  # [positions, vocab] in chunks of positions (Gemma's vocabulary is 262k)
        hidden = model.model(sequence).last_hidden_state[0]
        cap = getattr(config, "final_logit_softcapping", None)
        for h in hidden.split(512):
            logits = model.lm_head(h).float()
            yield torch.log_softmax(torch.tanh(logits / cap) * cap if cap else logits, -1)

    reference = list(log_probs())
    top2 = torch.cat(reference)[-len(greedy):].topk(2, -1).values
    margins = top2[:, 0] - top2[:, 1]  # log-softmax keeps the logits' differences
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    print(f"{args.model}: {len(prompt_ids)} prompt tokens, {len(greedy)} steps")
    for scheme in args.schemes:
        rounding["fn"] = {
            "float": lambda: None,
            "executorch": lambda: executorch_rounding(head_dim),
            "onnx": lambda: onnx_rounding(args.model, args.max_cache_len),
            "bfloat16": lambda: cast_rounding(torch.bfloat16),
            "float16": lambda: cast_rounding(torch.float16),
        }[scheme]()
        top, same, kl = [], 0, 0.0
        for ref, rounded in zip(reference, log_probs()):
            top.append(rounded.argmax(-1))
            same += int((top[-1] == ref.argmax(-1)).sum())
            kl += float((ref.exp() * (ref - rounded)).sum())
        rounding["fn"] = None
        positions = sequence.shape[1]
        differ = (torch.cat(top)[-len(greedy):] != torch.tensor(greedy)).nonzero().flatten().tolist()
        agreement, everywhere, kl = 1 - len(differ) / len(greedy), same / positions, kl / positions
        print(f"{scheme:>10}: top-1 agreement {agreement:.1%} ({len(differ)} differ, eager's margins "
              f"{[round(float(margins[i]), 3) for i in differ]}); every position: {everywhere:.2%}, mean KL {kl:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
