"""Shared test helpers: the eager reference (transformers' own generate), tolerant comparisons, and
the scripts in scripts/ loaded as modules."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"

# fp32 tolerance on logits, artifact vs eager transformers. Tiny presets have logits of magnitude
# ~10-25; fp32 reordering (XNNPACK kernels, our masks) moves them by ~1e-4 at most.
FP32_LOGIT_ATOL = 2e-3
# The same with an int8 KV cache, between calls of different lengths: the float reordering can round
# a cached key or value to the neighbouring int8 step (a few 1e-3 on a tiny preset's logits).
INT8_KV_LOGIT_ATOL = 1e-2


def fake_manifest(**fields):
    """A manifest with the fields a test gives and placeholders for the others: a fake program's."""
    from kvexport.artifact.manifest import Manifest, Source

    placeholders = dict(target="onnx", source=Source("fake"), dtype="float32", max_cache_len=512, vocab_size=128,
                        eos_token_ids=(), layers=(), program="model.onnx", files={})
    return Manifest(**{**placeholders, **fields})


def run_cli(capsys, *args) -> tuple[int, str, str]:
    """``kvexport ARGS`` in this process: its exit code, stdout and stderr."""
    from kvexport.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def assert_one_line_error(code, err, *phrases):
    """A user mistake: exit code 2, one ``kvexport: error:`` line holding each phrase, no traceback."""
    assert code == 2, err
    lines = [line for line in err.strip().splitlines() if line.startswith("kvexport: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for phrase in phrases:
        assert phrase in lines[0], lines[0]


def eager_reference(model, prompt_ids: list[int], max_new_tokens: int):
    """Greedy tokens and per-step logits from ``model.generate`` with its own DynamicCache."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt_ids):].tolist(), [l[0].float().numpy() for l in out.logits]


def eager_ids(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy token ids only (no logits kept: 700 steps of a 262k vocabulary would be 0.7 GB)."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(prompt_ids):].tolist()


def greedy_with(forward, prompt_ids: list[int], max_new_tokens: int, chunks: list[int] | None = None):
    """Greedy decoding through ``forward(tokens: list[int], start: int) -> logits``.

    ``chunks`` splits the prompt into several calls (chunked prefill); default one call.
    """
    chunks = chunks or [len(prompt_ids)]
    assert sum(chunks) == len(prompt_ids)
    pos = 0
    for n in chunks:
        logits = forward(prompt_ids[pos:pos + n], pos)
        pos += n
    ids, all_logits = [], []
    for _ in range(max_new_tokens):
        all_logits.append(np.asarray(logits, dtype=np.float32))
        ids.append(int(np.argmax(logits)))
        if len(ids) == max_new_tokens:
            break
        logits = forward([ids[-1]], pos)
        pos += 1
    return ids, all_logits


def torch_forward(module):
    """``forward(tokens, start)`` over a torch module with the wrapper's calling convention."""

    def forward(tokens, start):
        with torch.no_grad():
            out = module(torch.tensor([tokens]), torch.tensor([start]))
        return out[0].float().numpy()

    return forward


def assert_generation_matches(actual, expected, atol: float, what: str) -> None:
    """Same greedy ids and logits within ``atol`` at every step."""
    (ids, logits), (ref_ids, ref_logits) = actual, expected
    for step, (a, b) in enumerate(zip(logits, ref_logits)):
        diff = float(np.max(np.abs(a - b)))
        assert diff <= atol, f"{what}: logits differ by {diff:.3g} > {atol} at new token {step}"
    assert ids == ref_ids, f"{what}: token ids differ from eager transformers"


def effective_weight(module: torch.nn.Module) -> torch.Tensor:
    """What an 8da4w linear layer (kvexport's quantized module) multiplies its int8-rounded input by."""
    from kvexport.exporter.executorch.quantize import GROUP_SIZE, Int4GridLinear

    weight = module.weight.dequantize()
    if isinstance(module, Int4GridLinear):  # its offsets multiply block sums of the input
        offset = module.offset.dequantize() if hasattr(module.offset, "qdata") else module.offset
        weight = weight + offset.repeat_interleave(GROUP_SIZE, dim=1)
    return weight


def assert_on_grid(layer, weight: torch.Tensor) -> None:
    """``layer`` (an ``Int4GridLinear``) multiplies by ``weight``: its int4 levels and scales exactly,
    its offsets to within half their int8 step (one per output channel) where they are int8."""
    off = (effective_weight(layer) - weight).abs()
    half_step = layer.offset.scale.float() / 2 if hasattr(layer.offset, "qdata") else torch.zeros(1)
    assert bool((off <= half_step + 1e-5).all()), f"{float((off - half_step).max()):.3g} past half an offset step"
    assert float(half_step.max()) < 0.01 * float(weight.abs().max())  # the offsets' rounding is small


def load_script(name: str):
    """``scripts/<name>.py`` as a module (scripts/ is no package; each loads fresh)."""
    spec = importlib.util.spec_from_file_location(f"kvexport_script_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def edit_manifest(change, update_its_sum: bool = True):
    """A function of an artifact folder that edits its kvexport.json with ``change(manifest)``; with
    ``update_its_sum``, as a tool would that rewrites the sum file too, so that what is checked is
    the manifest's fields themselves."""
    from kvexport.artifact.manifest import sha256_file

    def damage(folder):
        manifest = json.loads((folder / "kvexport.json").read_text())
        change(manifest)
        (folder / "kvexport.json").write_text(json.dumps(manifest))
        if update_its_sum:
            (folder / "kvexport.json.sha256").write_text(f"{sha256_file(folder / 'kvexport.json')}  kvexport.json\n")

    return damage


def on_one_worker(group: str) -> pytest.MarkDecorator:
    """Under pytest-xdist (make test), the tests of one group run on one worker, one after the other:
    a module-scoped fixture they share (a real model loaded, quantized) is made once."""
    return pytest.mark.xdist_group(group)


# Tests that read the tiny 8da4w .pte (minutes to lower): on one worker, one after the other, so that
# none waits on the other worker's export of it.
TINY_8DA4W = on_one_worker("tiny-gemma3-8da4w")


def genai_greedy(folder: Path, prompt_ids: list[int], n: int) -> list[int]:
    """onnxruntime-genai's own greedy generator on the folder, as an app runs it (EOS masked until n)."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt_ids) + n, min_length=len(prompt_ids) + n, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array(prompt_ids, dtype=np.int32))
    ids = []
    while not generator.is_done():
        generator.generate_next_token()
        ids.append(int(generator.get_next_tokens()[0]))
    return ids


def write_tiny_gguf(path: Path, block_count: int | None = None, extra: dict | None = None, shapes: dict | None = None) -> Path:
    """tiny-llama's config as a float32 GGUF of random weights (llama.cpp's tensor names) and a
    placeholder vocabulary. ``block_count`` overrides the metadata's layer count (the tensors stay
    two layers'); ``extra`` adds tensors (name: shape); ``shapes`` gives tensors another shape."""
    import gguf

    from kvexport.models.presets import preset_config

    config = preset_config("tiny-llama")
    h, f, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    kv = config.num_key_value_heads * h // config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(h)
    writer.add_block_count(block_count or config.num_hidden_layers)
    writer.add_feed_forward_length(f)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"<t{i}>" for i in range(vocab)])
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types([1] * vocab)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    tensors = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,), "output.weight": (vocab, h)}
    for i in range(config.num_hidden_layers):
        tensors |= {
            f"blk.{i}.attn_norm.weight": (h,), f"blk.{i}.ffn_norm.weight": (h,), f"blk.{i}.attn_q.weight": (h, h),
            f"blk.{i}.attn_k.weight": (kv, h), f"blk.{i}.attn_v.weight": (kv, h), f"blk.{i}.attn_output.weight": (h, h),
            f"blk.{i}.ffn_gate.weight": (f, h), f"blk.{i}.ffn_up.weight": (f, h), f"blk.{i}.ffn_down.weight": (h, f),
        }  # fmt: skip
    rng = np.random.default_rng(0)
    for name, shape in (tensors | (extra or {}) | (shapes or {})).items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
