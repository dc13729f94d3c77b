"""``--quantize`` / ``--quantize-embedding``: the artifact runs the quantized model it claims to.

A tiny random model quantized to 4 bits no longer predicts what its float self predicts (random
weights have no structure for the scales to follow), so on tiny presets the artifact is held to the
*quantized* model computed in PyTorch: the quantized module (torchao's tensors) for 8da4w, and the
float model with its weights rounded as kvexport's ONNX int4 rewrite rounds them; each rounding is
checked on its own against weights built on a GGUF type's grid. Agreement
with float eager (``kvexport check``) is measured on the real models (docs/quantization.md).
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

import kvexport
from kvexport.artifact.manifest import read_manifest
from kvexport.exporter.executorch.quantize import GROUP_SIZE, quantize_model
from kvexport.exporter.quantization import Quantization
from kvexport.exporter.weight_grids import int4_blocks
from kvexport.models.presets import build_preset
from kvexport.runtime.programs import load_program

from tests.conftest import NEW_TOKENS, PROMPT
from tests.helpers import TINY_8DA4W, assert_on_grid, assert_one_line_error, eager_ids, effective_weight, run_cli


def teacher_forced(forward, ids: list[int], prompt_len: int) -> np.ndarray:
    """Logits for positions ``prompt_len - 1 ..``: the prompt in one call, then ``ids`` one by one."""
    logits = [forward(ids[:prompt_len], 0)]
    for pos in range(prompt_len, len(ids) - 1):
        logits.append(forward([ids[pos]], pos))
    return np.stack(logits)


def torch_logits(model, ids: list[int], prompt_len: int) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids[:-1]])).logits[0, prompt_len - 1:].float().numpy()


def agreement(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(a.argmax(-1) == b.argmax(-1)))


def assert_closer_to(got: np.ndarray, reference: np.ndarray, as_float: np.ndarray) -> None:
    """The artifact computes the quantized model: its logits are much nearer the quantized
    reference's than the float model's are. Not equal: the runtimes round activations to int8 on
    the fly (XNNPACK's 8da4w, MatMulNBits' accuracy level 4) a little differently from PyTorch,
    and near-ties of a random tiny model flip. A wrong scale, group or packing (the int4
    embedding's nibbles) puts the artifact at least as far off as the float model."""
    off = float(np.mean(np.abs(got - reference)))
    quantization_error = float(np.mean(np.abs(as_float - reference)))
    numbers = f"mean |artifact - reference| {off:.3g}, |float - reference| {quantization_error:.3g}, "
    numbers += f"top-1 agreement {agreement(got, reference):.2f} (float model: {agreement(got, as_float):.2f})"
    assert off < 0.5 * quantization_error, numbers
    assert agreement(got, reference) > agreement(got, as_float), numbers


def sequence(name: str):
    """(float model, prompt + float greedy continuation, prompt length)."""
    model, tokenizer = build_preset(name)
    ids = tokenizer(PROMPT).input_ids
    return model, ids + eager_ids(model, ids, NEW_TOKENS), len(ids)


def artifact_bytes(folder, manifest) -> int:
    return sum(entry["bytes"] for name, entry in manifest["files"].items() if name.startswith("model."))


# --- ExecuTorch: 8da4w linear layers, int8 / int4 embedding ------------------------------------


@pytest.mark.parametrize(
    "name, embedding, kernel, lm_head, grid",
    # Each 8da4w .pte is minutes of lowering: the options meet in three exports. The tied table with an
    # int4 lm_head but an int8 lookup: test_an_int4_lm_head_is_rounded_like_a_float_weight_and_its_tied_table_stays_8_bit.
    [pytest.param("tiny-gemma3", "int8", "embedding_byte", None, None, marks=TINY_8DA4W),
     ("tiny-smollm3", "int4", "embedding_4bit", "int4", None),
     ("tiny-llama", "int8", "embedding_byte", "int4", "symmetric")],
    ids=["gemma3-int8-embedding", "smollm3-tied-int4-embedding-int4-lm-head", "llama-peers-recipe-symmetric-grid"],
)
def test_8da4w_pte_runs_the_quantized_model(artifact, capsys, name, embedding, kernel, lm_head, grid):
    folder = artifact(name, "executorch", "8da4w", embedding, lm_head, quantize_grid=grid)
    manifest = read_manifest(folder).to_json()
    assert manifest["quantization"]["scheme"] == "8da4w"
    assert manifest["quantization"].get("grid") == grid
    assert manifest["export_options"].get("quantize_grid") == grid
    assert manifest["quantization"]["embedding"]["weights"] == embedding
    assert manifest["quantization"]["lm_head"]["weights"] == (lm_head or "int8")
    assert manifest["export_options"]["quantize"] == "8da4w"
    assert manifest["export_options"]["quantize_embedding"] == embedding
    assert manifest["export_options"].get("quantize_lm_head") == lm_head
    # The embedding lookup is ExecuTorch's quantized kernel, not torchao's dequantize of the whole table.
    assert manifest["quantized_embedding_ops"] == 1
    assert f"quantized_decomposed::{kernel}" in manifest["custom_ops"]

    model, ids, prompt_len = sequence(name)
    quantized = copy.deepcopy(model)
    assert quantize_model(quantized, Quantization("8da4w", embedding, lm_head, grid)) == []  # every tiny width is a multiple of 32
    got = teacher_forced(load_program(folder).forward, ids, prompt_len)
    reference = torch_logits(quantized, ids, prompt_len)
    as_float = torch_logits(model, ids, prompt_len)
    assert_closer_to(got, reference, as_float)
    if lm_head:  # check names the scheme it holds the artifact to
        _, _, err = run_cli(capsys, "check", folder, "--max-new-tokens", "4")
        scheme = "8da4w, symmetric int4" if grid else "8da4w"
        assert f"{scheme}, {lm_head} lm_head, {embedding} embedding" in err


@TINY_8DA4W
def test_8da4w_adds_no_op_outside_the_delegate_but_the_stacks_splits(artifact):
    """The int4 offsets (block means, a small matmul) run inside XNNPACK: the ops quantization adds
    outside it are the embedding's lookup kernel and, per layer, the split of the stacked q/k/v and
    gate/up products (``stacked_projections``; XNNPACK slices no tensor with a dynamic dim)."""
    fp32 = read_manifest(artifact("tiny-gemma3")).to_json()
    quantized = read_manifest(artifact("tiny-gemma3", "executorch", "8da4w", "int8")).to_json()
    splits = 2 * len(quantized["layers"])
    assert quantized["non_delegated_ops"] <= fp32["non_delegated_ops"] + 1 + splits
    assert quantized["delegated_calls"] <= fp32["delegated_calls"] + splits


def test_8da4w_keeps_each_weight_on_its_grid():
    """A weight read from a 4-bit GGUF (Q4_1, Q4_K) comes out of 8da4w exactly; one the source
    stores finer (Q8_0), and the lm_head, are int8 per output channel; a float weight spans each
    block's min..max in 16 levels. ExecuTorch's own recipe (symmetric int4, hqq scales) rounds a
    4-bit GGUF's weights onto a second grid: SmolLM2 agreed with float eager on 69% of tokens."""
    from kvexport.exporter.executorch.quantize import Int4GridLinear

    model, _ = build_preset("tiny-llama")
    attention = model.model.layers[0].self_attn
    rng = np.random.default_rng(6)
    with torch.no_grad():
        for linear, make in [(attention.q_proj, q4_1_weight), (attention.k_proj, q4_k_weight),
                             (attention.v_proj, lambda rng, n, k: finer_weight(rng, n, k, 32, 127))]:
            linear.weight.copy_(torch.from_numpy(make(rng, *linear.weight.shape)))
    original = {name: m.weight.detach().clone() for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert quantize_model(model, Quantization("8da4w")) == []
    layers = dict(model.named_modules())

    for name in ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"):
        assert isinstance(layers[name], Int4GridLinear)
        assert_on_grid(layers[name], original[name])
    for name in ("model.layers.0.self_attn.v_proj", "lm_head"):
        assert not isinstance(layers[name], Int4GridLinear)
        per_row = original[name].abs().amax(-1, keepdim=True) / 127
        expected = (original[name] / per_row).round() * per_row
        torch.testing.assert_close(effective_weight(layers[name]), expected, atol=1e-6, rtol=0)
    name = "model.layers.0.self_attn.o_proj"  # a float weight
    assert isinstance(layers[name], Int4GridLinear)
    assert_on_grid(layers[name], asymmetric_int4(original[name]))


@pytest.mark.parametrize("grid", ["exact", "symmetric"])
def test_8da4w_counts_the_linear_layers_on_the_step_s_status_line(monkeypatch, grid):
    """The quantize step (minutes at 8B parameters) says how many linear layers it has done."""
    from kvexport.exporter.executorch import quantize

    reported = []
    monkeypatch.setattr(quantize, "report", reported.append)
    model, _ = build_preset("tiny-llama")
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    quantize_model(model, Quantization("8da4w", grid=None if grid == "exact" else "symmetric"))
    assert reported == [f"{done} of {linears} linear layers" for done in range(linears)]


def test_an_int4_lm_head_is_rounded_like_a_float_weight_and_its_tied_table_stays_8_bit():
    """``--quantize-lm-head int4``: the lm_head spans each block's min..max in 16 levels (its source
    here is float), while the embedding it is tied to keeps its own 8-bit table."""
    from kvexport.exporter.executorch.quantize import Int4GridLinear

    model, _ = build_preset("tiny-smollm3")  # tied embeddings
    original = model.lm_head.weight.detach().clone()
    assert quantize_model(model, Quantization("8da4w", "int8", "int4")) == []
    assert isinstance(model.lm_head, Int4GridLinear)
    assert_on_grid(model.lm_head, asymmetric_int4(original))
    table_error = (effective_weight(model.get_input_embeddings()) - original).abs().max()
    head_error = (effective_weight(model.lm_head) - original).abs().max()
    assert table_error < head_error / 4  # 8-bit levels (256 of them), not 4-bit ones (16)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_embeddings_quantized_in_pieces_of_rows_are_executorchs_recipe(scheme):
    """``quantize_embeddings`` quantizes a table in pieces of rows, from bfloat16 where the load
    kept it so: the values, scales and zero points of ExecuTorch's ``quantize_model_`` over the
    whole float32 table."""
    from executorch.extension.llm.export.quantize import quantize_model_

    from kvexport.exporter.executorch.quantize import quantize_embeddings
    from kvexport.exporter.quantization import EMBEDDING_SCHEMES

    torch.manual_seed(0)
    table = torch.randn(1000, 64).to(torch.bfloat16)
    whole = torch.nn.Sequential(torch.nn.Embedding.from_pretrained(table.float()))
    quantize_model_(whole, qembedding_config=EMBEDDING_SCHEMES[scheme], qembedding_group_size=GROUP_SIZE if scheme == "int4" else 0)
    pieces = torch.nn.Sequential(torch.nn.Embedding.from_pretrained(table))
    assert quantize_embeddings(pieces, scheme, rows_per_piece=300) == []
    expected, got = whole[0].weight, pieces[0].weight
    for field in ("qdata", "scale", "zero_point"):
        assert torch.equal(getattr(got, field), getattr(expected, field)), field
    assert (got.block_size, got.target_dtype, got.dtype) == (expected.block_size, expected.target_dtype, expected.dtype)
    ids = torch.tensor([[0, 299, 300, 999]])
    assert torch.equal(pieces(ids), whole(ids))


def test_int4_grid_linear_computes_the_exact_weight():
    """The layer adds the offsets back in float: off from ``x @ W.T`` only by its int8 activations,
    far less than symmetric int4 would be."""
    from kvexport.exporter.executorch.quantize import Int4GridLinear

    rng = np.random.default_rng(7)
    weight = q4_1_weight(rng, 64, 128)
    layer = Int4GridLinear.from_blocks(*int4_blocks(weight), None)
    x = torch.from_numpy(rng.standard_normal((1, 5, 128)).astype(np.float32))
    with torch.no_grad():
        got = layer(x).numpy()
    exact = x.numpy() @ weight.T
    symmetric = x.numpy() @ fake_symmetric_int4(weight).T
    assert np.abs(got - exact).max() < 0.25 * np.abs(symmetric - exact).max()


def test_a_block_of_one_value_gets_a_positive_scale_and_stays_exact():
    """XNNPACK refuses a zero scale (an embedding's all-zero padding row read as a tied int4
    lm_head made the ``.pte`` fail to load); the offset makes up for the scale it gets instead."""
    from kvexport.exporter.executorch.quantize import Int4GridLinear

    weight = q4_1_weight(np.random.default_rng(8), 4, 64)
    weight[1] = 0.0
    weight[2, :32] = 0.25
    q, scale, offset = int4_blocks(weight)
    assert (scale == 0).sum() == 3
    layer = Int4GridLinear.from_blocks(q, scale, offset, None)
    assert bool((layer.weight.scale > 0).all())
    assert_on_grid(layer, torch.from_numpy(weight))


@TINY_8DA4W
def test_8da4w_pte_is_smaller(artifact):
    fp32 = read_manifest(artifact("tiny-gemma3")).to_json()
    quantized = read_manifest(artifact("tiny-gemma3", "executorch", "8da4w", "int8")).to_json()
    # Tiny layers carry a large share of per-call overhead and float norms; real models shrink ~4x.
    assert artifact_bytes(None, quantized) < artifact_bytes(None, fp32) / 2.5


# --- ONNX: int4 MatMulNBits + GatherBlockQuantized ---------------------------------------------


def asymmetric_int4(weight: torch.Tensor) -> torch.Tensor:
    """A linear ``weight`` [out, in] as ONNX int4 stores it: blocks of 32 along the input dim, 16
    levels from the block's minimum to its maximum."""
    blocks = weight.reshape(weight.shape[0], -1, GROUP_SIZE)
    lo, hi = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    step = (hi - lo) / 15
    q = torch.where(step == 0, torch.zeros_like(blocks), ((blocks - lo) / step).round().clamp(0, 15))
    return (lo + q * step).reshape(weight.shape)


def symmetric_int8(weight: torch.Tensor) -> torch.Tensor:
    """The lm_head and the embedding table: blocks of 32 along the hidden dim, scale = the block's
    largest magnitude / 127 (GGUF's Q8_0 rule)."""
    blocks = weight.reshape(weight.shape[0], -1, GROUP_SIZE)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale == 0, torch.zeros_like(blocks), (blocks / scale).round().clamp(-127, 127))
    return (q * scale).reshape(weight.shape)


def int4_with_zero_points(weight: torch.Tensor) -> torch.Tensor:
    """``--quantize-lm-head int4`` on ONNX: blocks of 32 along the input dim, ``step * (q - zero)``
    with a whole ``zero`` in 0..15, the one whose step can be smallest and still reach the block's
    min and max (with zero, always a level)."""
    blocks = weight.reshape(weight.shape[0], -1, GROUP_SIZE)
    lo, hi = blocks.amin(-1, keepdim=True).clamp(max=0), blocks.amax(-1, keepdim=True).clamp(min=0)
    candidates = [torch.maximum(-lo / z if z else torch.where(lo < 0, torch.inf, 0.0),
                                hi / (15 - z) if z < 15 else torch.where(hi > 0, torch.inf, 0.0)) for z in range(16)]
    step, zero = torch.stack(candidates).min(0)
    step = torch.where(step == 0, 1.0, step)
    q = (blocks / step + zero).round().clamp(0, 15)
    return ((q - zero) * step).reshape(weight.shape)


def as_onnx_int4(model: torch.nn.Module, lm_head: str = "int8") -> torch.nn.Module:
    rounded = copy.deepcopy(model)
    head = rounded.get_output_embeddings()
    if lm_head == "int4":  # a copy of its own, the table (tied or not) stays as it was for the lookup
        head.weight = torch.nn.Parameter(int4_with_zero_points(head.weight.detach()), requires_grad=False)
    with torch.no_grad():
        for module in rounded.modules():
            if isinstance(module, torch.nn.Embedding) or (module is head and lm_head == "int8"):
                module.weight.copy_(symmetric_int8(module.weight))  # a tied table: once, 8-bit both ways
            elif isinstance(module, torch.nn.Linear):
                module.weight.copy_(asymmetric_int4(module.weight))
    return rounded


def test_int4_onnx_export_runs_the_int4_model(tmp_path, capsys):
    folder = tmp_path / "q"
    code, out, err = run_cli(
        capsys, "export", "tiny-gemma3", "--target", "onnx", "--max-cache-len", "64", "--quantize", "int4", "-o", folder
    )
    assert code == 0, err
    assert "✓ quantize " in err and "MatMulNBits" in err  # its own progress step
    manifest = read_manifest(folder).to_json()
    assert manifest["quantization"]["scheme"] == "int4"
    assert manifest["export_options"]["quantize"] == "int4"
    assert "quantize_embedding" not in manifest["export_options"]
    ops = manifest["quantized_ops"]
    # Per layer q/k/v as one, o, gate/up as one and down (2 layers x 4); the lm_head; the lookup.
    assert ops == {"MatMulNBits": 9, "GatherBlockQuantized": 1}
    assert manifest["external_data"] == "model.onnx.data"
    # Rewritten by onnx, which creates it owner-only: as readable as the graph, for whoever deploys it.
    assert (folder / "model.onnx.data").stat().st_mode == (folder / "model.onnx").stat().st_mode
    assert [i["name"] for i in manifest["interface"]["inputs"]][:2] == ["input_ids", "attention_mask"]
    nbits = nbits_ops(folder / "model.onnx", with_block=True)  # the projections 4-bit, the lm_head 8-bit
    assert sorted(bits for bits, *_ in nbits) == [4] * 8 + [8]
    # The manifest names the lm_head's block the graph holds.
    assert (8, manifest["vocab_size"], manifest["quantization"]["lm_head"]["block_size"]) in nbits

    model, ids, prompt_len = sequence("tiny-gemma3")
    got = teacher_forced(load_program(folder).forward, ids, prompt_len)
    reference = torch_logits(as_onnx_int4(model), ids, prompt_len)
    as_float = torch_logits(model, ids, prompt_len)
    assert_closer_to(got, reference, as_float)
    # onnxruntime-genai runs the same graph, its sliding buffers a slack longer than the window: the
    # kernel sums in another order, and MatMulNBits' int8 activations round some steps' last bits
    # the other way. As close to the int4 model as kvexport's runner.
    in_genai = teacher_forced(load_program(folder, runner="genai").forward, ids, prompt_len)
    assert_closer_to(in_genai, reference, as_float)


def test_an_int4_lm_head_on_onnx_reads_zero_points_and_the_lookup_keeps_its_8_bit_table(artifact, capsys):
    """``--quantize int4 --quantize-lm-head int4`` on a tied model: the lm_head is MatMulNBits int4
    with a zero point per block (no offsets), the lookup still reads the 8-bit table, and the graph
    computes that model."""
    import onnx

    folder = artifact("tiny-smollm3", "onnx", "int4", None, "int4")
    manifest = read_manifest(folder).to_json()
    assert manifest["quantization"]["lm_head"]["weights"] == "int4"
    assert manifest["export_options"]["quantize_lm_head"] == "int4"
    assert manifest["quantized_ops"] == {"MatMulNBits": 9, "GatherBlockQuantized": 1}
    assert sorted(bits for bits, *_ in nbits_ops(folder / "model.onnx")) == [4] * 9
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    head = next(n for n in graph.node if n.op_type == "MatMulNBits"
                and next(a.i for a in n.attribute if a.name == "N") == manifest["vocab_size"])
    assert len(head.input) == 4 and head.input[3].endswith("_zero_points")
    lookup = next(n for n in graph.node if n.op_type == "GatherBlockQuantized")
    assert next(a.i for a in lookup.attribute if a.name == "bits") == 8

    model, ids, prompt_len = sequence("tiny-smollm3")
    got = teacher_forced(load_program(folder).forward, ids, prompt_len)
    reference = torch_logits(as_onnx_int4(model, lm_head="int4"), ids, prompt_len)
    assert_closer_to(got, reference, torch_logits(model, ids, prompt_len))
    in_genai = teacher_forced(load_program(folder, runner="genai").forward, ids, prompt_len)
    np.testing.assert_allclose(in_genai, got, rtol=0, atol=1e-4)  # no sliding layers: the same buffers, the same logits
    _, _, err = run_cli(capsys, "check", folder, "--max-new-tokens", "4")  # check names the scheme
    assert "quantized (int4, int4 lm_head, " in err


def test_an_int4_onnx_lm_head_reaches_each_blocks_min_and_max():
    """Each block's levels reach its min and max (no clipping, every weight within half a step),
    packed as MatMulNBits reads them: two levels and two zero points a byte, low nibble first."""
    from kvexport.exporter.onnx.quantize import _int4_with_zero_points

    rng = np.random.default_rng(0)
    weight = rng.standard_normal((96, 70)).astype(np.float32)  # [K, N]: 3 blocks, an odd count
    weight[:32, 0] = 0  # a block of zeros
    weight[32:64, 1] = np.abs(weight[32:64, 1])  # all positive: zero is level 0
    weight[:32, 2] = -np.abs(weight[:32, 2])  # all negative: zero is level 15
    data, step, zero = _int4_with_zero_points(weight)
    n, blocks = step.shape
    assert data.shape == (70, 3, 16) and zero.shape == (70, 2) and (n, blocks) == (70, 3)
    levels = np.stack([data & 15, data >> 4], -1).reshape(n, blocks, GROUP_SIZE).astype(np.float32)
    zeros = np.stack([zero & 15, zero >> 4], -1).reshape(n, -1)[:, :blocks].astype(np.float32)
    dequantized = (levels - zeros[..., None]) * step[..., None]
    original = weight.T.reshape(n, blocks, GROUP_SIZE)
    assert np.all(np.abs(dequantized - original) <= 0.5001 * step[..., None])
    np.testing.assert_allclose(dequantized.reshape(n, -1), int4_with_zero_points(torch.from_numpy(weight.T.copy())).numpy(),
                               rtol=0, atol=1e-6)
    assert zeros[2, 0] == 15 and zeros[1, 1] == 0 and np.all(dequantized[0, 0] == 0)


def nbits_ops(path, with_block: bool = False) -> list[tuple[int, ...]]:
    """(bits, N) of every MatMulNBits node, in graph order; (bits, N, block_size) ``with_block``."""
    import onnx
    from onnx import helper

    graph = onnx.load(str(path), load_external_data=False).graph
    attributes = [{a.name: helper.get_attribute_value(a) for a in n.attribute} for n in graph.node if n.op_type == "MatMulNBits"]
    return [(a["bits"], a["N"], *([a["block_size"]] if with_block else [])) for a in attributes]


def test_int4_onnx_is_smaller_and_reexports_identically(artifact, tmp_path):
    first = artifact("tiny-gemma3", "onnx", "int4")
    fp32 = read_manifest(artifact("tiny-gemma3", "onnx")).to_json()
    manifest = read_manifest(first).to_json()
    # The tiny model is mostly its 8-bit embedding table and lm_head (untied: two matrices).
    assert manifest["files"]["model.onnx.data"]["bytes"] < fp32["files"]["model.onnx.data"]["bytes"] / 1.5
    options = manifest["export_options"]
    again = tmp_path / "again"
    kvexport.export(options["model"], options["target"], again, max_cache_len=options["max_cache_len"],
                    quantize=options["quantize"], quiet=True)  # the CLI's bytes, whatever this process's hash seed
    for name, entry in manifest["files"].items():
        assert read_manifest(again).to_json()["files"][name] == entry, name


def test_attention_reads_the_stacked_projection_packed_and_computes_the_same(artifact, tmp_path, monkeypatch):
    """A full-attention layer's GroupQueryAttention reads the stacked q/k/v projection whole (its
    packed-QKV form, no Split): the same logits as the graph with the Split, to the last bit."""
    import shutil

    import onnx

    from kvexport.exporter.onnx import quantize as onnx_quantize
    from kvexport.runtime.onnx_program import OnnxProgram

    source = artifact("tiny-llama", "onnx")
    folders = {}
    for packed in (True, False):
        folder = folders[packed] = tmp_path / f"packed-{packed}"
        shutil.copytree(source, folder)
        with monkeypatch.context() as patch:
            if not packed:
                patch.setattr(onnx_quantize, "_pack_attention_inputs", lambda nodes: None)
            onnx_quantize.quantize_onnx(folder / "model.onnx", "model.onnx.data")
    graph = onnx.load(str(folders[True] / "model.onnx"), load_external_data=False).graph
    attention = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert attention and all(list(n.input[1:3]) == ["", ""] for n in attention)
    assert not any(n.op_type == "Split" and n.output[0] in {a.input[0] for a in attention} for n in graph.node)
    unpacked = onnx.load(str(folders[False] / "model.onnx"), load_external_data=False).graph
    assert all(n.input[1] for n in unpacked.node if n.op_type == "GroupQueryAttention")

    manifest = read_manifest(source)
    programs = [OnnxProgram(folders[packed], manifest, "cpu") for packed in (True, False)]
    tokens = list(range(10, 40))
    for start, call in ((0, tokens[:20]), (20, tokens[20:21]), (21, tokens[21:])):
        packed_logits, split_logits = (p.forward(call, start) for p in programs)
        np.testing.assert_array_equal(packed_logits, split_logits)


# --- kvexport check on a quantized artifact: agreement, teacher-forced --------------------------


def test_check_reports_agreement_on_a_quantized_artifact(artifact, capsys):
    folder = artifact("tiny-gemma3", "onnx", "int4")
    code, out, err = run_cli(capsys, "check", folder, "--json")
    report = json.loads(out)
    assert report["mode"] == "agreement" and report["min_agreement"] == 0.95
    for prompt in report["prompts"]:
        # Teacher-forced: every step is compared, past any disagreement.
        assert prompt["compared_steps"] == prompt["new_tokens"] > 0
        assert prompt["top1_agreement"] == pytest.approx(prompt["agreed_steps"] / prompt["compared_steps"])
        assert prompt["max_logit_diff"] == pytest.approx(max(prompt["logit_diff_per_step"]))
        assert len(prompt["disagreement_margins"]) == prompt["compared_steps"] - prompt["agreed_steps"]
        # EOS is never fed: what follows one is no generation a runner makes.
        assert prompt["suppressed_tokens"] == read_manifest(folder).to_json()["eos_token_ids"] != []
        assert not set(prompt["suppressed_tokens"]) & set(prompt["eager_ids"])
    # A random 4-bit tiny model does not reach 95%: the check says so and fails.
    assert report["ok"] == all(p["top1_agreement"] >= 0.95 for p in report["prompts"])
    assert code == (0 if report["ok"] else 1)
    code, out, err = run_cli(capsys, "check", folder, "--max-new-tokens", "8")
    assert "top-1 agreement" in out and "teacher-forced steps" in out
    assert ("eager's own margin at the" in out) == any(p["disagreement_margins"] for p in report["prompts"])
    assert "quantized" in err and "95%" in err


def test_min_agreement_sets_a_quantized_artifacts_bar(artifact, capsys):
    """``check --min-agreement``: the artifact passes at the bar its lowest prompt reaches, fails just
    above it; refused for an artifact held to identical tokens, and outside (0, 1]."""
    folder = artifact("tiny-gemma3", "onnx", "int4")
    prompts = ["--prompt", "The capital of France is", "--max-new-tokens", "32"]
    code, out, _ = run_cli(capsys, "check", folder, *prompts, "--json")
    lowest = min(p["top1_agreement"] for p in json.loads(out)["prompts"])
    assert 0 < lowest < 1  # a random 4-bit tiny model: some steps agree, some do not
    code, out, err = run_cli(capsys, "check", folder, *prompts, "--min-agreement", str(lowest))
    assert code == 0 and out.rstrip().endswith("PASS"), out + err
    assert f"must be >= {lowest:.0%}" in err
    code, out, _ = run_cli(capsys, "check", folder, *prompts, "--min-agreement", str(lowest + 0.01), "--json")
    assert code == 1 and json.loads(out)["min_agreement"] == pytest.approx(lowest + 0.01)
    code, _, err = run_cli(capsys, "check", artifact("tiny-gemma3", "onnx"), "--min-agreement", "0.9")
    assert_one_line_error(code, err, "--min-agreement is for a quantized artifact")
    code, _, err = run_cli(capsys, "check", folder, "--min-agreement", "90")
    assert_one_line_error(code, err, "--min-agreement is a fraction of the steps", "got 90")


def test_teacher_forcing_on_a_float_artifact_agrees_fully(artifact):
    from kvexport.checker.check import check_prompt

    model, tokenizer = build_preset("tiny-gemma3")
    ids = tokenizer(PROMPT).input_ids
    report = check_prompt(load_program(artifact("tiny-gemma3")), model, ids, NEW_TOKENS, 0.05, teacher_forcing=True)
    assert report.match and report.top1_agreement == 1.0 and report.compared_steps == NEW_TOKENS
    assert report.max_logit_diff < 0.05 and report.disagreement_margins == []


def test_teacher_forcing_never_feeds_nor_counts_a_suppressed_token(artifact):
    from kvexport.checker.check import check_prompt

    model, tokenizer = build_preset("tiny-gemma3")
    ids = tokenizer(PROMPT).input_ids
    program = load_program(artifact("tiny-gemma3"))
    free = check_prompt(program, model, ids, NEW_TOKENS, 0.05, teacher_forcing=True)
    banned = sorted(set(free.eager_ids))[:2]  # tokens eager picks when nothing is held back
    report = check_prompt(program, model, ids, NEW_TOKENS, 0.05, teacher_forcing=True, suppress=banned)
    assert report.eager_ids != free.eager_ids and not set(banned) & set(report.eager_ids)
    # The float artifact's top choice is taken without them too, so it still agrees at every step.
    assert report.top1_agreement == 1.0 and report.compared_steps == NEW_TOKENS
    assert not set(banned) & set(report.artifact_ids) and report.max_logit_diff < 0.05


def test_teacher_forcing_goes_on_past_a_divergence(artifact):
    from kvexport.checker.check import check_prompt

    model, tokenizer = build_preset("tiny-llama")  # another model's artifact: it diverges at once
    ids = tokenizer(PROMPT).input_ids
    report = check_prompt(load_program(artifact("tiny-mistral")), model, ids, NEW_TOKENS, 0.05, teacher_forcing=True)
    assert not report.match and report.first_divergence == 0
    assert report.compared_steps == NEW_TOKENS and report.top1_agreement < 0.5
    # Eager's margin at each disagreement, the first one as eager_margin; eager's pick is its argmax.
    assert len(report.disagreement_margins) == report.compared_steps - report.agreed_steps
    assert report.disagreement_margins[0] == report.eager_margin and min(report.disagreement_margins) >= 0
    assert report.eager_ids == eager_ids(model, ids, NEW_TOKENS)  # eager's own greedy run, undisturbed


# --- mistakes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, phrases",
    [
        (["--quantize", "int4"], ["--quantize int4 is for --target onnx", "use --quantize 8da4w"]),
        (["--target", "onnx", "--quantize", "8da4w"], ["--quantize 8da4w is for --target executorch", "use --quantize int4"]),
        (["--target", "onnx", "--quantize", "int4", "--quantize-embedding", "int8"], ["--quantize-embedding is for --target executorch"]),
        (["--quantize", "int3"], ["unknown --quantize 'int3'", "8da4w (--target executorch), int4 (--target onnx)"]),
        (["--quantize", "8da4w", "--quantize-embedding", "int2"], ["unknown --quantize-embedding 'int2'", "int8, int4"]),
        (["--quantize", "8da4w", "--dtype", "float16"], ["--quantize takes --dtype float32"]),
        (["--quantize-lm-head", "int4"], ["--quantize-lm-head goes with --quantize 8da4w (--target executorch)"]),
        (["--target", "onnx", "--quantize-lm-head", "int4"], ["--quantize-lm-head goes with --quantize int4 (--target onnx)"]),
        (["--quantize", "8da4w", "--quantize-lm-head", "int2"], ["unknown --quantize-lm-head 'int2'", "int8, int4"]),
    ],
    ids=["int4-on-executorch", "8da4w-on-onnx", "embedding-on-onnx", "unknown-scheme", "unknown-embedding-scheme", "float16",
         "lm-head-without-8da4w", "lm-head-without-int4", "unknown-lm-head-scheme"],
)
def test_quantize_mistakes_get_one_line_before_loading(tmp_path, capsys, monkeypatch, args, phrases):
    from kvexport.exporter import pipeline

    monkeypatch.setattr(pipeline.sources, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    code, _, err = run_cli(capsys, "export", "tiny-llama", *args, "-o", tmp_path / "x")
    assert_one_line_error(code, err, *phrases)
    assert not (tmp_path / "x").exists()


def test_a_tied_lm_head_read_through_a_transpose_is_quantized_too(tmp_path):
    """Real tied models (SmolLM2, Gemma 3) come out of the exporter as MatMul(x, Transpose(table)),
    and the logits then pass through more ops (the last position's selection): the quantizer must
    still see a constant weight and know it for the lm_head, or the largest matrix stays float."""
    import onnx
    from onnx import helper

    table = np.random.default_rng(0).standard_normal((96, 64)).astype(np.float32)
    path = save_graph(tmp_path, [
        helper.make_node("Gather", ["table", "ids"], ["embedded"]),
        helper.make_node("Transpose", ["table"], ["table_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["embedded", "table_t"], ["all_logits"]),
        helper.make_node("Identity", ["all_logits"], ["logits"]),
    ], {"table": table}, output_shape=[1, "T", 96])
    ids = np.array([[3, 17, 95]], dtype=np.int64)
    got, ops = quantize_and_run(path, {"ids": ids})
    assert ops == {"MatMulNBits": 1, "GatherBlockQuantized": 1}
    assert nbits_ops(path) == [(8, 96)]
    rounded = symmetric_int8(torch.from_numpy(table)).numpy()
    assert np.abs(got - rounded[ids] @ rounded.T).max() < 0.01 * np.abs(got).max()
    # Stored once: the lookup and the lm_head read one 8-bit initializer, and the data file holds
    # one byte per table entry (a second copy would double it) plus the scales.
    graph = onnx.load(str(path), load_external_data=False).graph
    reads = {n.op_type: n.input[0 if n.op_type == "GatherBlockQuantized" else 1] for n in graph.node
             if n.op_type in ("GatherBlockQuantized", "MatMulNBits")}
    assert reads["GatherBlockQuantized"] == reads["MatMulNBits"]
    assert (tmp_path / "model.onnx.data").stat().st_size < 1.5 * table.size


def quantize_one_projection(tmp_path, weight: np.ndarray, x: np.ndarray):
    """``x @ weight.T`` then an identity head (8-bit, as every lm_head), quantized and run:
    (result, quantized op counts, the graph's path)."""
    from onnx import helper

    n, k = weight.shape
    path = save_graph(tmp_path, [
        helper.make_node("MatMul", ["x", "w"], ["hidden"]),
        helper.make_node("MatMul", ["hidden", "head"], ["logits"]),
    ], {"w": np.ascontiguousarray(weight.T), "head": np.eye(n, dtype=np.float32)}, [1, 5, n], input_name="x", input_shape=[1, 5, k])  # fmt: skip
    got, ops = quantize_and_run(path, {"x": x})
    return got, ops, path


def q4_1_weight(rng, n: int, k: int) -> np.ndarray:
    """A [out, in] weight as GGUF's Q4_1 stores one: ``m + d * q`` per block of 32, q in 0..15, the
    block's min and max at levels 0 and 15 (Q4_1's rule)."""
    q = rng.integers(0, 16, size=(n, k // GROUP_SIZE, GROUP_SIZE))
    q[..., 0], q[..., 1] = 0, 15
    d = rng.uniform(0.001, 0.02, size=(n, k // GROUP_SIZE, 1))
    m = rng.uniform(-0.1, 0.0, size=(n, k // GROUP_SIZE, 1))
    return (m + d * q).reshape(n, k).astype(np.float32)


def test_int4_reproduces_a_weight_already_on_a_4_bit_grid(tmp_path):
    """A weight read from a 4-bit GGUF (Q4_1) comes out exactly: the rewrite adds no error of its
    own. Symmetric int4 would round it again."""
    rng = np.random.default_rng(1)
    n, k = 64, 128  # n: the head below (an identity) is quantized too, so a multiple of 32
    weight = q4_1_weight(rng, n, k)
    levels, scale, offset = int4_blocks(weight)
    rebuilt = (scale[..., None] * (levels.astype(np.float32) - 8) + offset[..., None]).reshape(n, k)
    assert np.abs(rebuilt - weight).max() < 1e-6

    x = rng.standard_normal((1, 5, k)).astype(np.float32)
    got, ops, _ = quantize_one_projection(tmp_path, weight, x)
    assert ops == {"MatMulNBits": 2}
    exact = x @ weight.T
    symmetric = x @ fake_symmetric_int4(weight).T
    # Off only by the int8 activations (accuracy_level 4), far less than a second rounding would be.
    assert np.abs(got - exact).max() < 0.25 * np.abs(symmetric - exact).max()


@pytest.mark.parametrize("input_rank_known", [True, False], ids=["block-sums-by-reduce", "block-sums-by-matmul"])
def test_projections_reading_one_input_run_as_one_kernel(tmp_path, input_rank_known):
    """q/k/v (and gate/up) read the same input: one MatMulNBits over their weights stacked along N,
    one offset term, then a Split that gives each projection its own output, still exact. The
    offsets' per-block sums of the input are a reshape and a sum where the input's rank is known
    (always, in the exporter's graphs), else a MatMul by a block-membership matrix."""
    import onnx
    from onnx import helper

    rng = np.random.default_rng(2)
    k, sizes = 128, (64, 32, 32)
    weights = [q4_1_weight(rng, n, k) for n in sizes]
    x = rng.standard_normal((1, 5, k)).astype(np.float32)
    projected = "x" if input_rank_known else "x_again"  # an Identity's output has no declared shape
    path = save_graph(tmp_path, [
        helper.make_node("Identity", ["x"], ["x_again"]),
        *[helper.make_node("MatMul", [projected, f"w{i}"], [f"y{i}"]) for i in range(3)],
        helper.make_node("Concat", ["y0", "y1", "y2"], ["hidden"], axis=-1),
        helper.make_node("MatMul", ["hidden", "head"], ["logits"]),
    ], {**{f"w{i}": np.ascontiguousarray(w.T) for i, w in enumerate(weights)}, "head": np.eye(128, dtype=np.float32)},
        [1, 5, 128], input_name="x", input_shape=[1, 5, k])  # fmt: skip
    got, ops = quantize_and_run(path, {"x": x})
    assert ops == {"MatMulNBits": 2}  # the three projections, and the head
    assert nbits_ops(path) == [(4, sum(sizes)), (8, 128)]
    graph = onnx.load(str(path), load_external_data=False).graph
    assert [list(n.output) for n in graph.node if n.op_type == "Split"] == [["y0", "y1", "y2"]]
    assert any(n.op_type == "ReduceSum" for n in graph.node) == input_rank_known
    exact = x @ np.concatenate(weights).T
    symmetric = x @ np.concatenate([fake_symmetric_int4(w) for w in weights]).T
    assert np.abs(got - exact).max() < 0.25 * np.abs(symmetric - exact).max()


def q4_k_weight(rng, n: int, k: int) -> np.ndarray:
    """GGUF's Q4_K: ``d * q - m`` per block of 32 with q in 0..15, where the block need not use its
    grid's lowest or highest level (d and m are rounded to 6-bit multiples of a super-block scale)."""
    q = rng.integers(2, 14, size=(n, k // GROUP_SIZE, GROUP_SIZE))
    d = rng.uniform(0.001, 0.02, size=(n, k // GROUP_SIZE, 1))
    m = rng.uniform(0.0, 0.1, size=(n, k // GROUP_SIZE, 1))
    return (d * q - m).reshape(n, k).astype(np.float32)


def finer_weight(rng, n: int, k: int, run: int, half_levels: int) -> np.ndarray:
    """A symmetric grid finer than 4 bits, ``d * (q - half_levels)`` with one ``d`` per ``run``:
    GGUF's Q5_0 (run 32, 16), Q6_K (run 16, 32) or Q8_0 (run 32, 127)."""
    q = rng.integers(0, 2 * half_levels, size=(n, k // run, run))
    q[..., 0] = 0  # the run's largest magnitude, as the quantizers choose d
    d = rng.uniform(0.0005, 0.005, size=(n, k // run, 1)).astype(np.float32)
    return (d * (q - half_levels)).reshape(n, k).astype(np.float32)


@pytest.mark.parametrize("kind", ["q4_1", "q4_k"])
def test_int4_blocks_keep_a_4_bit_grid_exactly(kind):
    from kvexport.exporter.weight_grids import finer_than_4_bits

    rng = np.random.default_rng(3)
    weight = (q4_1_weight if kind == "q4_1" else q4_k_weight)(rng, 64, 128)
    levels, scale, offset = int4_blocks(weight)
    rebuilt = (scale[..., None] * (levels.astype(np.float32) - 8) + offset[..., None]).reshape(weight.shape)
    assert np.abs(rebuilt - weight).max() < 1e-6
    assert not finer_than_4_bits(weight)


@pytest.mark.parametrize("kind", ["q4_k", "float"])
def test_int4_blocks_of_a_tall_weight_come_out_the_same_a_few_rows_at_a_time(kind):
    rng = np.random.default_rng(12)
    weight = q4_k_weight(rng, 70, 64) if kind == "q4_k" else rng.standard_normal((70, 64)).astype(np.float32)
    whole = int4_blocks(weight, rows_per_call=len(weight))
    for got, expected in zip(int4_blocks(weight, rows_per_call=16), whole):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("kind", ["q6_k", "float"])
def test_int8_blocks_of_a_tall_weight_come_out_the_same_a_few_rows_at_a_time(kind):
    """As for int4: a 262k-row table goes through int8_blocks a piece at a time (Gemma 3's int4
    ONNX export peaked 0.7 GB higher with it whole)."""
    from kvexport.exporter.weight_grids import grid_steps, int8_blocks

    rng = np.random.default_rng(13)
    weight = finer_weight(rng, 70, 64, 16, 32) if kind == "q6_k" else rng.standard_normal((70, 64)).astype(np.float32)
    steps = grid_steps(weight, 16) if kind == "q6_k" else None
    whole = int8_blocks(weight, 16, steps, rows_per_call=len(weight))
    for got, expected in zip(int8_blocks(weight, 16, steps, rows_per_call=16), whole):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("run, half_levels", [(32, 16), (16, 32), (32, 127)], ids=["q5_0", "q6_k", "q8_0"])
def test_a_weight_finer_than_4_bits_goes_8_bit_exactly(tmp_path, run, half_levels):
    """Rounding a 5-, 6- or 8-bit GGUF weight to 4 bits would add error the float reference does
    not have: such a projection is an 8-bit MatMulNBits on the weight's own grid, in blocks of 32
    where the source has one step per 32 (Q5_0, Q8_0) and of 16 where it steps runs of 16 (Q6_K)."""
    from kvexport.exporter.weight_grids import finer_than_4_bits, grid_steps, int8_blocks

    rng = np.random.default_rng(4)
    n, k = 64, 128
    weight = finer_weight(rng, n, k, run, half_levels)
    assert finer_than_4_bits(weight)
    q, scale = int8_blocks(weight, 16, grid_steps(weight, 16))
    rebuilt = ((q.astype(np.float32).reshape(n, k // 16, 16) - 128) * scale[..., None]).reshape(n, k)
    assert np.abs(rebuilt - weight).max() < 1e-6

    x = rng.standard_normal((1, 5, k)).astype(np.float32)
    got, ops, path = quantize_one_projection(tmp_path, weight, x)
    # the projection, and the head (8-bit as always, in blocks of 64: the largest of 128/64/32 dividing its K = n)
    assert nbits_ops(path, with_block=True) == [(8, n, run), (8, n, 64)]
    stored = _stored_int8_weight(path, node=0)
    assert np.abs(stored - weight).max() < 1e-6  # what the graph holds is the weight itself
    # What is left is accuracy_level 4's int8 activations (blocks as large as the weight's).
    exact = x @ weight.T
    as_4_bit = x @ fake_symmetric_int4(weight).T
    assert np.abs(got - exact).max() < 0.2 * np.abs(as_4_bit - exact).max()


def test_the_lm_head_and_embedding_blocks_are_the_largest_of_128_64_32_dividing_k():
    """Gemma 3 (K 640) gets blocks of 128, SmolLM2 (K 576) of 64: MatMulNBits runs Gemma 3's
    262,144 x 640 head ~20% faster in blocks of 128 than of 32."""
    from kvexport.exporter.onnx.quantize import table_block

    assert [table_block(k) for k in (96, 576, 640, 2048)] == [32, 64, 128, 128]


def _stored_int8_weight(path, node: int) -> np.ndarray:
    """The [N, K] weight the ``node``-th MatMulNBits (8-bit) of the graph at ``path`` holds."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(path))
    initializers = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    matmul = [n for n in model.graph.node if n.op_type == "MatMulNBits"][node]
    attributes = {a.name: helper.get_attribute_value(a) for a in matmul.attribute}
    n, k, block = attributes["N"], attributes["K"], attributes["block_size"]
    q = initializers[matmul.input[1]].reshape(n, k // block, block).astype(np.float32) - 128
    return (q * initializers[matmul.input[2]].reshape(n, k // block, 1)).reshape(n, k)


def test_a_float_weight_is_not_finer_than_4_bits():
    from kvexport.exporter.weight_grids import finer_than_4_bits

    assert not finer_than_4_bits(np.random.default_rng(5).standard_normal((64, 128)).astype(np.float32))


def fake_symmetric_int4(weight: np.ndarray) -> np.ndarray:
    blocks = weight.reshape(weight.shape[0], -1, GROUP_SIZE)
    scale = np.abs(blocks).max(-1, keepdims=True) / 7.5
    return (np.clip(np.rint(blocks / scale), -8, 7) * scale).reshape(weight.shape)


def save_graph(tmp_path, nodes, weights: dict, output_shape, input_name="ids", input_shape=(1, "T")):
    """A float graph saved as the ONNX target saves one: weights in one external file."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    input_type = TensorProto.INT64 if input_name == "ids" else TensorProto.FLOAT
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(input_name, input_type, list(input_shape))],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, list(output_shape))],
        [numpy_helper.from_array(w, name) for name, w in weights.items()],
    )
    path = tmp_path / "model.onnx"
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)  # as torch.onnx writes
    onnx.save_model(model, str(path), save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    return path


def quantize_and_run(path, feeds: dict, **options):
    """``quantize_onnx``'s rewrite of the graph at ``path`` (``options``: its keywords), run."""
    import onnx
    import onnxruntime as ort

    from kvexport.exporter.onnx.quantize import quantize_onnx

    ops = quantize_onnx(path, "model.onnx.data", **options)
    onnx.checker.check_model(str(path), full_check=True)
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    return got, ops


# --- --quantize-grid symmetric: the peers' rounding ---------------------------------------------

def test_symmetric_grid_on_executorch_is_executorchs_own_8da4w_recipe():
    """Every linear weight comes out as ExecuTorch's ``quantize_model_(qlinear_config="8da4w")`` (what
    export_llm and optimum-executorch apply) makes it, the weights kvexport would keep on their grid
    included; the lm_head is int8 unless ``--quantize-lm-head int4`` asks for the recipe's int4."""
    from executorch.extension.llm.export.quantize import quantize_model_
    from torchao.quantization import IntxUnpackedToInt8Tensor

    model, _ = build_preset("tiny-gemma3")
    with torch.no_grad():  # one projection on a 4-bit GGUF grid, which the source grid keeps exactly
        proj = model.model.layers[0].self_attn.q_proj
        proj.weight.copy_(torch.from_numpy(q4_1_weight(np.random.default_rng(3), *proj.weight.shape)))
    recipe = copy.deepcopy(model)
    quantize_model_(recipe, qlinear_config="8da4w")
    for lm_head in ("int4", "int8"):
        ours = copy.deepcopy(model)
        assert quantize_model(ours, Quantization("8da4w", None, lm_head, "symmetric")) == []
        theirs = dict(recipe.named_modules())
        head = ours.get_output_embeddings()
        linears = [(name, m) for name, m in ours.named_modules() if isinstance(m, torch.nn.Linear)]
        assert len(linears) == 2 * 7 + 1
        for name, module in linears:
            mine, reference = module.weight, theirs[name].weight
            assert isinstance(mine, IntxUnpackedToInt8Tensor), name
            if module is head and lm_head == "int8":
                assert mine.target_dtype == torch.int8 and tuple(mine.block_size) == (1, mine.shape[1])
                continue
            assert mine.target_dtype == torch.int4 and tuple(mine.block_size) == (1, GROUP_SIZE), name
            assert not mine.zero_point.any(), name  # symmetric
            assert torch.equal(mine.qdata, reference.qdata) and torch.equal(mine.scale, reference.scale), name
    q = dict(ours.named_modules())["model.layers.0.self_attn.q_proj"].weight
    assert not torch.equal(q.dequantize(), proj.weight)  # rounded a second time: the source grid is not kept


def test_symmetric_grid_on_onnx_is_onnxruntimes_own_quantizer(tmp_path):
    """q/k/v stacked as one MatMulNBits (no offsets, no zero points) and an int4 lm_head compute
    what ONNX Runtime's ``MatMulNBitsQuantizer`` (symmetric, blocks of 32, accuracy level 4: what
    onnxruntime-genai's builder runs) makes of the same float graph, a weight on a 4-bit GGUF grid
    rounded again like any other."""
    import onnx
    from onnx import helper
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    rng = np.random.default_rng(4)
    k, sizes = 128, (64, 32, 32)
    weights = [q4_1_weight(rng, n, k) for n in sizes]
    head = rng.standard_normal((128, 96)).astype(np.float32) * 0.05
    x = rng.standard_normal((1, 5, k)).astype(np.float32)
    nodes = [*[helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]) for i in range(3)],
             helper.make_node("Concat", ["y0", "y1", "y2"], ["hidden"], axis=-1),
             helper.make_node("MatMul", ["hidden", "head"], ["logits"])]
    initializers = {**{f"w{i}": np.ascontiguousarray(w.T) for i, w in enumerate(weights)}, "head": head}
    (tmp_path / "ours").mkdir()
    (tmp_path / "theirs").mkdir()
    ours = save_graph(tmp_path / "ours", nodes, initializers, [1, 5, 96], input_name="x", input_shape=[1, 5, k])
    got, ops = quantize_and_run(ours, {"x": x}, lm_head="int4", symmetric=True)
    assert ops == {"MatMulNBits": 2}
    graph = onnx.load(str(ours), load_external_data=False).graph
    assert [len(n.input) for n in graph.node if n.op_type == "MatMulNBits"] == [3, 3]  # no zero points
    assert not any(n.op_type in ("ReduceSum", "Add") for n in graph.node)  # no block offsets

    theirs = save_graph(tmp_path / "theirs", nodes, initializers, [1, 5, 96], input_name="x", input_shape=[1, 5, k])
    config = DefaultWeightOnlyQuantConfig(block_size=GROUP_SIZE, is_symmetric=True, accuracy_level=4)
    quantizer = MatMulNBitsQuantizer(onnx.load(str(theirs)), algo_config=config)
    quantizer.process()
    import onnxruntime as ort

    reference = ort.InferenceSession(quantizer.model.model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, reference, rtol=0, atol=1e-5)
    exact = x @ np.concatenate(weights).T @ head
    assert np.abs(got - exact).max() > 1e-3  # the GGUF's grid was not kept


def ort_symmetric_int4(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] as ONNX Runtime's own symmetric int4 quantizer rounds it, dequantized."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits

    n, k = weight.shape
    packed = np.zeros((n, k // GROUP_SIZE, GROUP_SIZE // 2), np.uint8)
    scales = np.zeros((n, k // GROUP_SIZE), np.float32)
    quantize_matmul_4bits(packed, np.ascontiguousarray(weight.detach().numpy().T), scales,
                          np.zeros((n, k // GROUP_SIZE), np.uint8), GROUP_SIZE, n, k, True)
    levels = np.stack([packed & 15, packed >> 4], -1).reshape(n, k // GROUP_SIZE, GROUP_SIZE).astype(np.float32)
    return torch.from_numpy(((levels - 8) * scales[..., None]).reshape(n, k))


def test_symmetric_int4_onnx_export_runs_the_symmetric_model(tmp_path, capsys):
    import onnx

    folder = tmp_path / "q"
    code, _, err = run_cli(capsys, "export", "tiny-gemma3", "--target", "onnx", "--max-cache-len", "64", "--quantize", "int4",
                           "--quantize-grid", "symmetric", "-o", folder)
    assert code == 0, err
    assert "int4 linear weights, symmetric" in err
    manifest = read_manifest(folder).to_json()
    assert manifest["quantization"]["grid"] == "symmetric" and manifest["quantization"]["linear"]["symmetric"] is True
    assert manifest["export_options"]["quantize_grid"] == "symmetric"
    assert manifest["quantized_ops"] == {"MatMulNBits": 9, "GatherBlockQuantized": 1}
    assert sorted(bits for bits, _ in nbits_ops(folder / "model.onnx")) == [4] * 8 + [8]
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    assert not [i.name for i in graph.initializer if i.name.endswith("_offsets")]  # no block offsets

    model, ids, prompt_len = sequence("tiny-gemma3")
    rounded = copy.deepcopy(model)
    head = rounded.get_output_embeddings()
    with torch.no_grad():
        for module in rounded.modules():
            if isinstance(module, torch.nn.Embedding) or module is head:
                module.weight.copy_(symmetric_int8(module.weight))
            elif isinstance(module, torch.nn.Linear):
                module.weight.copy_(ort_symmetric_int4(module.weight))
    got = teacher_forced(load_program(folder).forward, ids, prompt_len)
    assert_closer_to(got, torch_logits(rounded, ids, prompt_len), torch_logits(model, ids, prompt_len))
    _, _, err = run_cli(capsys, "check", folder, "--max-new-tokens", "4")
    assert "(int4, symmetric int4," in err


def test_symmetric_grid_refused_without_quantize_or_unknown(tmp_path, capsys, monkeypatch):
    from kvexport.exporter import pipeline

    monkeypatch.setattr(pipeline.sources, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    for args, phrases in [
        (["--quantize-grid", "symmetric"], ["--quantize-grid goes with --quantize 8da4w (--target executorch)"]),
        (["--target", "onnx", "--quantize", "int4", "--quantize-grid", "sym"], ["unknown --quantize-grid 'sym'", "source, symmetric"]),
    ]:
        code, _, err = run_cli(capsys, "export", "tiny-llama", *args, "-o", tmp_path / "x")
        assert_one_line_error(code, err, *phrases)
        assert not (tmp_path / "x").exists()
