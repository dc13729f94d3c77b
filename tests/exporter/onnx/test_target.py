"""The ONNX artifact of every preset, run by ONNX Runtime, against eager transformers; its folder and manifest."""

from __future__ import annotations

import collections
import json
import subprocess
import sys

import onnx
import pytest

from kvexport.artifact.manifest import read_manifest
from kvexport.models.presets import build_preset, preset_config
from kvexport.runtime.programs import load_program

from tests.conftest import NEW_TOKENS, PROMPT, TEST_CACHE_LEN
from tests.helpers import (
    FP32_LOGIT_ATOL, assert_generation_matches, assert_one_line_error, eager_reference, greedy_with, run_cli,
)


def test_onnx_matches_eager_past_the_window(tiny, artifact):
    name, model, tokenizer = tiny
    ids = tokenizer(PROMPT).input_ids
    program = load_program(artifact(name, "onnx"))
    got = greedy_with(program.forward, ids, NEW_TOKENS)
    assert_generation_matches(got, eager_reference(model, ids, NEW_TOKENS), FP32_LOGIT_ATOL, name)


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-qwen3.5"])
def test_onnx_chunked_prefill_and_reuse(artifact, name):
    # Gemma 3: a ring of window 6 and a static layer; chunks shorter and longer than the window.
    # Qwen 3.5: linear attention's states, passed from call to call through the graph (the runner's
    # two buffers per state), and zeroed by the graph at a new sequence.
    model, tokenizer = build_preset(name)
    ids = tokenizer(PROMPT).input_ids
    program = load_program(artifact(name, "onnx"))
    expected = eager_reference(model, ids, NEW_TOKENS)
    for chunks in ([40, 4], [3, 7, 11, 23], [1] * len(ids), [len(ids)]):  # the last one also proves a fresh start works
        got = greedy_with(program.forward, ids, NEW_TOKENS, chunks=chunks)
        assert_generation_matches(got, expected, FP32_LOGIT_ATOL, f"chunks {chunks}")


def test_folder_layout_and_manifest_describe_the_graph(artifact):
    folder = artifact("tiny-gemma3", "onnx")
    manifest = read_manifest(folder).to_json()
    assert manifest["target"] == "onnx" and manifest["program"] == "model.onnx"
    assert {"model.onnx", "model.onnx.data", "tokenizer.json"} <= set(manifest["files"])
    assert "onnxruntime" in manifest["versions"] and "executorch" not in manifest["versions"]
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph

    def dims(value):
        return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]

    interface = manifest["interface"]
    # Every graph input and output is described, in order, with the graph's own names and shapes.
    for described, actual in ((interface["inputs"], graph.input), (interface["outputs"], graph.output)):
        assert [(e["name"], e["shape"]) for e in described] == [(v.name, dims(v)) for v in actual]
        assert all(e["meaning"] for e in described)
    by_name = {e["name"]: e for e in interface["inputs"] + interface["outputs"]}
    # onnxruntime-genai's interface: its input names, an attention mask as wide as the positions so far.
    assert (by_name["input_ids"]["dtype"], by_name["input_ids"]["shape"]) == ("int64", [1, "T"])
    assert (by_name["attention_mask"]["dtype"], by_name["attention_mask"]["shape"]) == ("int64", [1, "total"])
    assert (by_name["logits"]["dtype"], by_name["logits"]["shape"]) == ("float32", [1, 1, manifest["vocab_size"]])
    for layer in manifest["layers"]:
        i, heads, dim = layer["index"], layer["kv_heads"], layer["head_dim"]
        # Head-major whole buffers in and out (GroupQueryAttention), as many rows as the runtime gives:
        # kvexport's runner max_cache_len for a full layer and the window for a sliding one.
        rows = "window_rows" if layer["cache"] == "ring" else "cache_rows"
        assert layer["slots"] == (layer["window"] if layer["cache"] == "ring" else TEST_CACHE_LEN)
        for kv in ("key", "value"):
            past, present = by_name[f"past_key_values.{i}.{kv}"], by_name[f"present.{i}.{kv}"]
            assert past["shape"] == present["shape"] == [1, heads, rows, dim]
    assert [layer["cache"] for layer in manifest["layers"]] == ["ring", "static"]
    assert manifest["kv_cache_bytes"] == sum(2 * 4 * layer["kv_heads"] * layer["slots"] * layer["head_dim"] for layer in manifest["layers"])
    assert interface["max_tokens_per_call"] == manifest["interface"]["max_tokens_per_call"] == TEST_CACHE_LEN
    assert set(interface["symbols"]) == {"T", "total", "cache_rows", "window_rows"}
    assert {"layout", "static", "ring"} <= set(interface["cache"])


def test_genai_config_describes_the_folder(artifact):
    """What onnxruntime-genai reads: the graph's names, the heads, the sliding layers with buffers it
    never slides itself, past and present sharing one buffer, the cache's length."""
    folder = artifact("tiny-gemma3", "onnx")
    manifest = read_manifest(folder).to_json()
    assert manifest["genai_config"] == "genai_config.json" and "genai_config.json" in manifest["files"]
    config = json.loads((folder / "genai_config.json").read_text())
    decoder = config["model"]["decoder"]
    tiny = preset_config("tiny-gemma3")
    assert decoder["filename"] == "model.onnx"
    assert (decoder["num_hidden_layers"], decoder["num_attention_heads"], decoder["num_key_value_heads"], decoder["head_size"],
            decoder["hidden_size"]) == (2, tiny.num_attention_heads, 1, 16, tiny.hidden_size)
    assert decoder["inputs"]["past_key_names"] % 1 == "past_key_values.1.key"
    assert decoder["outputs"]["present_value_names"] % 0 == "present.0.value"
    assert decoder["sliding_window"] == {"window_size": 6, "layers": [0], "slide_key_value_cache": False,
                                         "slide_inputs": False}
    assert config["model"]["context_length"] == config["search"]["max_length"] == TEST_CACHE_LEN
    assert config["search"]["past_present_share_buffer"] is True
    assert (config["model"]["bos_token_id"], config["model"]["eos_token_id"]) == (manifest["bos_token_id"], *manifest["eos_token_ids"])


def test_every_layer_attends_with_one_group_query_attention_node(artifact):
    """Each node takes and returns the graph's cache buffers directly (so a runner binding present
    to past's memory gets rows written in place), reads its lengths from the attention mask as
    onnxruntime-genai's builder writes them, and rotates its own query and key; a sliding layer's
    has the window as its local_window_size and keeps its window-sized buffer itself."""
    folder = artifact("tiny-gemma3", "onnx")  # layers 0-2: sliding; layer 3: full
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    nodes = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    layers = read_manifest(folder).to_json()["layers"]
    heads = preset_config("tiny-gemma3").num_attention_heads
    producers = {out: node for node in graph.node for out in node.output}
    assert len(nodes) == len(layers) and all(n.domain == "com.microsoft" for n in nodes)
    for node, layer in zip(nodes, layers):
        i = layer["index"]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert (attrs["num_heads"], attrs["kv_num_heads"]) == (heads, layer["kv_heads"])
        assert list(node.input[3:5]) == [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        assert list(node.output[1:]) == [f"present.{i}.key", f"present.{i}.value"]
        seqlens, total = producers[node.input[5]], producers[node.input[6]]
        assert producers[producers[seqlens.input[0]].input[0]].op_type == "ReduceSum"
        assert producers[producers[total.input[0]].input[0]].op_type == "Shape"
        assert len(node.input) == 9 and attrs["do_rotary"] == 1  # then its own cos/sin tables
        if layer["cache"] == "static":
            assert "local_window_size" not in attrs and "sliding_window_cache" not in attrs
        else:
            assert (attrs["local_window_size"], attrs["sliding_window_cache"]) == (layer["window"], 1)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_the_output_projection_reads_attention_as_it_comes_out(artifact, name):
    """Attention's ``[1, T, heads * head_dim]`` output is no longer viewed per head and back before
    the output projection: each GroupQueryAttention's output feeds MatMuls directly, and no
    Reshape chain in the graph ends in the shape it started from."""
    graph = onnx.load(str(artifact(name, "onnx") / "model.onnx"), load_external_data=False).graph
    readers = collections.defaultdict(list)
    for node in graph.node:
        for name_in in node.input:
            readers[name_in].append(node.op_type)
    attention = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert attention and all(readers[n.output[0]] == ["MatMul"] for n in attention)
    shapes = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in [*graph.input, *graph.value_info]}
    producers = {out: node for node in graph.node for out in node.output}
    for node in graph.node:
        if node.op_type == "Reshape":
            start = node.input[0]
            while start in producers and producers[start].op_type == "Reshape":
                start = producers[start].input[0]
            assert shapes.get(start) != shapes.get(node.output[0]) or start not in shapes, node.name


def _op_counts(folder) -> collections.Counter:
    return collections.Counter(n.op_type for n in onnx.load(str(folder / "model.onnx"), load_external_data=False).graph.node)


@pytest.mark.parametrize("name, norms", [("tiny-llama", 2 * 2 + 1), ("tiny-gemma3", 6 * 2 + 1)])
def test_norms_and_rotations_are_onnx_runtime_kernels(artifact, name, norms):
    """Every RMS norm is one (Skip)SimplifiedLayerNormalization node (Gemma 3: four per layer plus
    the per-head q/k norms; then the final one); every layer's GroupQueryAttention rotates its own
    query and key, a sliding layer's too (its kernel counts positions, not rows)."""
    folder = artifact(name, "onnx")
    ops = _op_counts(folder)
    assert ops["SimplifiedLayerNormalization"] + ops["SkipSimplifiedLayerNormalization"] == norms
    assert ops["Pow"] == 0 and ops["Neg"] == 0  # no norm or rotate_half left as loose ops
    assert ops["RotaryEmbedding"] == 0
    # No layout change is left: Gemma 3's per-head norm runs on the projection's own layout instead of
    # between two transposes (each a node every step dispatches).
    assert ops["Transpose"] == 0
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    rotating = [n for n in graph.node if n.op_type == "GroupQueryAttention" and _attributes(n).get("do_rotary") == 1]
    assert len(rotating) == len(read_manifest(folder).layers)


def test_a_bfloat16_graph_is_the_float16_graph_in_bfloat16(artifact):
    """``--dtype bfloat16`` (the GPU's dtype for models that overflow float16, as Gemma 3 does): the
    float16 graph's nodes, rotations folded into the attention (its tables evaluated through a
    float32 cast: ONNX Runtime's Python binding returns no bfloat16), every float input and output
    in bfloat16."""
    half, bf16 = (artifact("tiny-gemma3", "onnx", dtype=dtype) for dtype in ("float16", "bfloat16"))
    assert _op_counts(bf16) == _op_counts(half)
    graph = onnx.load(str(bf16 / "model.onnx"), load_external_data=False).graph
    rotating = [n for n in graph.node if n.op_type == "GroupQueryAttention" and _attributes(n).get("do_rotary") == 1]
    assert len(rotating) == len(read_manifest(bf16).layers)
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.output]}
    floats = {name: t for name, t in types.items() if name not in ("input_ids", "attention_mask")}
    assert floats and set(floats.values()) == {onnx.TensorProto.BFLOAT16}, floats
    # Initializers: the float16 graph's, each float16 one in bfloat16 (the float32 ones, as Gemma's
    # norms compute in float32, stay).
    in_half = onnx.load(str(half / "model.onnx"), load_external_data=False).graph.initializer
    as_bf16 = {onnx.TensorProto.FLOAT16: onnx.TensorProto.BFLOAT16}
    assert sorted((list(i.dims), as_bf16.get(i.data_type, i.data_type)) for i in in_half) == \
        sorted((list(i.dims), i.data_type) for i in graph.initializer)


@pytest.mark.parametrize("name, layer_type", [("tiny-llama", None), ("tiny-gemma3", "full_attention")])
def test_rotating_attention_reads_transformers_rotary_tables(artifact, name, layer_type):
    """The cos/sin tables a full-attention node reads are transformers' own for positions
    0 .. max_cache_len - 1 (Gemma 3: the global layers' rotary embedding, not the local one)."""
    import numpy as np
    import torch
    from onnx import numpy_helper

    folder = artifact(name, "onnx")
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    tables = {i.name: numpy_helper.to_array(i) for i in graph.initializer if i.name.startswith("rotary_table")}
    model, _ = build_preset(name)
    positions = torch.arange(TEST_CACHE_LEN)[None]
    x = torch.zeros(1, TEST_CACHE_LEN, model.config.hidden_size)
    with torch.no_grad():
        cos, sin = model.model.rotary_emb(x, positions, *([layer_type] if layer_type else []))
    half = cos.shape[-1] // 2
    for node in graph.node:
        full = "local_window_size" not in _attributes(node)
        if node.op_type == "GroupQueryAttention" and _attributes(node).get("do_rotary") == 1 and full:
            got_cos, got_sin = tables[node.input[7]], tables[node.input[8]]
            assert got_cos.shape == (TEST_CACHE_LEN, half)
            np.testing.assert_allclose(got_cos, cos[0, :, :half].numpy(), atol=1e-6, rtol=0)
            np.testing.assert_allclose(got_sin, sin[0, :, :half].numpy(), atol=1e-6, rtol=0)


def _attributes(node) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def test_a_sliding_buffer_goes_to_group_query_attention_as_it_is(artifact):
    """tiny-gemma3 has one KV head, as Gemma 3 270M: each sliding layer's buffer is read by its
    GroupQueryAttention node alone (its parity past the window: the first test)."""
    folder = artifact("tiny-gemma3", "onnx")
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    layers = read_manifest(folder).to_json()["layers"]
    rings = [f"past_key_values.{layer['index']}.{kv}" for layer in layers if layer["cache"] == "ring" for kv in ("key", "value")]
    readers = {name: [n.op_type for n in graph.node if name in n.input] for name in rings}
    assert rings and all(ops == ["GroupQueryAttention"] for ops in readers.values()), readers
    assert {layer["kv_heads"] for layer in layers} == {1}


def test_prefill_chunk_below_the_window_limits_each_call(tmp_path, artifact, monkeypatch):
    """ONNX Runtime sizes memory per call, so --prefill-chunk is the interface's limit: the runner
    prefills in calls of at most that many tokens, with eager's result; without it a call may be
    longer than the window."""
    from kvexport.exporter.pipeline import ExportOptions, export_model
    from kvexport.progress import Progress
    from kvexport.runtime.onnx_program import OnnxProgram

    folder = tmp_path / "chunk4"
    export_model(ExportOptions("tiny-gemma3", "onnx", folder, TEST_CACHE_LEN, prefill_chunk=4), Progress(quiet=True))
    assert read_manifest(folder).max_tokens_per_call == 4
    assert read_manifest(artifact("tiny-gemma3", "onnx")).max_tokens_per_call == TEST_CACHE_LEN

    calls = []
    original = OnnxProgram._call
    monkeypatch.setattr(OnnxProgram, "_call", lambda self, tokens, start: calls.append(len(tokens)) or original(self, tokens, start))
    model, tokenizer = build_preset("tiny-gemma3")
    ids = tokenizer(PROMPT).input_ids
    got = greedy_with(load_program(folder).forward, ids, NEW_TOKENS)
    assert_generation_matches(got, eager_reference(model, ids, NEW_TOKENS), FP32_LOGIT_ATOL, "prefill in chunks of 4")
    assert max(calls) == 4 and sum(calls) == len(ids) + NEW_TOKENS - 1


def test_a_family_with_its_own_rotation_exports_it_as_is(artifact):
    # GPT-OSS rotates with its own function: the swap leaves it alone (its parity is the first test).
    graph = onnx.load(str(artifact("tiny-gpt-oss", "onnx") / "model.onnx"), load_external_data=False).graph
    assert not any(n.op_type == "RotaryEmbedding" for n in graph.node)
    assert not any(_attributes(n).get("do_rotary") for n in graph.node if n.op_type == "GroupQueryAttention")


@pytest.mark.parametrize("name, attribute, input_slot", [("tiny-gemma2", "softcap", None), ("tiny-gpt-oss", None, 11)])
def test_soft_capping_and_sinks_are_the_kernel_s_own(artifact, name, attribute, input_slot):
    """Gemma 2's soft-capped scores are GroupQueryAttention's ``softcap``, gpt-oss's attention
    sinks its ``head_sink`` input: every layer one node, the only one that reads its cache."""
    graph = onnx.load(str(artifact(name, "onnx") / "model.onnx"), load_external_data=False).graph
    nodes = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert len(nodes) == preset_config(name).num_hidden_layers
    pasts = {v.name for v in graph.input if v.name.startswith("past_key_values.")}
    assert {n.op_type for n in graph.node if pasts & set(n.input)} == {"GroupQueryAttention"}
    # One Tanh left in Gemma 2: its final logits' soft-cap, after the last layer.
    assert sum(n.op_type == "Tanh" for n in graph.node) == (1 if name == "tiny-gemma2" else 0)
    if attribute:
        assert all(_attributes(n)[attribute] == preset_config(name).attn_logit_softcapping for n in nodes)
    if input_slot:
        assert all(len(n.input) > input_slot and n.input[input_slot] for n in nodes)


def test_float16_export_is_within_the_float16_tolerance(tmp_path, capsys):
    out = tmp_path / "fp16"
    code, out_text, err = run_cli(capsys, "tiny-gemma3", "--target", "onnx", "--dtype", "float16", "-o", out, "--max-cache-len", "64", "--json")
    assert code == 0, err
    # The exporter printed nothing on stdout; float16 runs eager once first (it refuses a model that overflows).
    assert set(json.loads(out_text)["seconds"]) == {"load", "probe", "export", "lower", "save"}
    assert json.loads((out / "kvexport.json").read_text())["interface"]["outputs"][0]["dtype"] == "float16"
    code, out_text, err = run_cli(capsys, "check", out, "--max-new-tokens", "12", "--json")
    assert code == 0, err
    report = json.loads(out_text)
    assert report["ok"] and report["logit_tolerance"] == 0.5, report


def test_a_model_failing_onnx_checker_leaves_no_folder(tmp_path, capsys, monkeypatch):
    def reject(*args, **kwargs):
        raise onnx.checker.ValidationError("Field 'type' of 'value_info' is required but missing.")

    monkeypatch.setattr(onnx.checker, "check_model", reject)
    code, _, err = run_cli(capsys, "tiny-llama", "--target", "onnx", "-o", tmp_path / "out", "--max-cache-len", "16", "--quiet")
    assert_one_line_error(code, err, "does not pass onnx.checker", "value_info")
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its staging copy


def test_a_quiet_export_prints_nothing(tmp_path):
    """``--quiet`` in a fresh process (where import-time chatter appears): not even torch.onnx's
    notice that torchvision's ops are missing."""
    done = subprocess.run(
        [sys.executable, "-c", "from kvexport.cli import main; main()", "tiny-llama", "--target", "onnx",
         "-o", str(tmp_path / "out"), "--max-cache-len", "16", "--quiet"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("", "")


# Ops whose output may alias their input in ONNX Runtime (no copy): their consumers read the input too.
_ALIASING_OPS = {"Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten"}


def _reads_not_before_writes(graph) -> dict[str, list[str]]:
    """For each ``GroupQueryAttention`` node, the nodes that read its past key or value (directly or
    through an op that may alias it; ``Shape`` reads no data) and that it does not depend on: the
    runner binds past and present to one buffer the kernel writes in place, so such a read could
    run after the write."""
    producer = {out: node for node in graph.node for out in node.output}
    consumers = collections.defaultdict(list)
    for node in graph.node:
        for name in node.input:
            consumers[name].append(node)
    missing = {}
    for gqa in (n for n in graph.node if n.op_type == "GroupQueryAttention"):
        ancestors, stack = set(), [gqa]
        while stack:
            for name in stack.pop().input:
                if (node := producer.get(name)) is not None and id(node) not in ancestors:
                    ancestors.add(id(node))
                    stack.append(node)
        readers, stack = [], [gqa.input[3], gqa.input[4]]
        while stack:
            for node in consumers[stack.pop()]:
                if node is gqa or node.op_type in ("Shape", "Size"):
                    continue
                readers.append(node)
                if node.op_type in _ALIASING_OPS:
                    stack.extend(node.output)
        missing[gqa.name] = [f"{n.op_type} {n.name}" for n in readers if id(n) not in ancestors]
    return missing


def test_onnx_chunked_layer_reads_its_past_before_the_kernel_writes_it(artifact, tmp_path):
    """Llama 4's chunked layer reads its past in plain ops and lets the kernel write the call's rows
    into the same buffer in place: the kernel must depend, by data, on every read of the past, in
    the saved graph and in the graph ONNX Runtime runs after its optimizations."""
    import onnxruntime as ort

    folder = artifact("tiny-llama4", "onnx")
    saved = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(str(tmp_path / "optimized.onnx"), load_external_data=False).graph
    for graph in (saved, optimized):
        missing = _reads_not_before_writes(graph)
        assert len(missing) == 2 and not any(missing.values()), missing  # a chunked layer and a full one
        # The check itself: with the kernel's query detached from the plain-ops attention, the
        # chunked layer's reads are no longer ordered before its write.
        detached = onnx.GraphProto()
        detached.CopyFrom(graph)
        for node in detached.node:
            if node.op_type == "GroupQueryAttention":
                node.input[0] = "detached_query"
        assert sum(bool(m) for m in _reads_not_before_writes(detached).values()) == 1


def test_a_tiny_norm_epsilon_stays_in_the_graph(tmp_path):
    """Helium adds an epsilon of 1e-8 in its RMS norm: onnxscript's optimizer removed it as an
    addition of (nearly) zero, and the padding token's embedding (zeros) then gave NaN logits."""
    import numpy as np
    import torch

    from kvexport import api
    from kvexport.models.presets import build_tiny, tiny_config

    model, tokenizer = build_tiny(tiny_config("helium", {"head_dim": 16}))
    assert model.config.rms_norm_eps == 1e-8
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    api.export(str(tmp_path / "model"), "onnx", tmp_path / "onnx", max_cache_len=TEST_CACHE_LEN, quiet=True)
    pad = model.config.pad_token_id
    got = np.asarray(load_program(tmp_path / "onnx").forward([pad], 0)).ravel()
    with torch.no_grad():
        want = model(torch.tensor([[pad]])).logits[0, -1].numpy()
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=FP32_LOGIT_ATOL)
