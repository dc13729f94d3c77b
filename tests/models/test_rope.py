"""Every rope type transformers has: exact on both targets, generating past the length where the
type's rotation could change, or refused in one line before the weights load.

transformers fixes the rotary frequencies when the model is built, except for two types that it
recomputes at each forward call from the length so far (``dynamic_rope_update``): ``dynamic``
(NTK) rescales them only past ``max_position_embeddings``, which no export reaches; ``longrope``
switches every position to its long factors past ``original_max_position_embeddings`` (and Phi-3's
generation then recomputes the cache), so a cache longer than that is refused.
"""

from __future__ import annotations

import collections

import pytest
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvexport.errors import UnsupportedModelError
from kvexport.exporter.pipeline import ExportOptions, export_model
from kvexport.models import presets
from kvexport.models.architecture import check_rope
from kvexport.progress import Progress
from kvexport.runtime.programs import load_program

from tests.helpers import (
    FP32_LOGIT_ATOL, assert_generation_matches, assert_one_line_error, eager_reference, greedy_with, run_cli,
)
from tests.test_cli import snapshot

THETA = 10000.0
ORIGINAL = 64  # original_max_position_embeddings where a type has one
CACHE = 128  # twice that: generations cross it
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": THETA,
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
    "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0],  # far from the short ones: a mix-up shows
    "original_max_position_embeddings": ORIGINAL,
}
# Two layers (the rotation is the same in each), head_dim 16: eight frequencies.
_SMALL = {"num_hidden_layers": 2, "head_dim": 16}

# rope type -> (model_type, config overrides, max_cache_len of the export).
ROPE_TYPES = {
    "default": ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": THETA}}, CACHE),
    "linear": ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": THETA, "factor": 4.0}}, CACHE),
    # Rescaled only past max_position_embeddings, which bounds the cache: generated to its last position.
    "dynamic": (
        "llama",
        {"max_position_embeddings": CACHE, "rope_parameters": {"rope_type": "dynamic", "rope_theta": THETA, "factor": 4.0}},
        CACHE,
    ),
    "yarn": (
        "llama",
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": THETA, "factor": 4.0, "original_max_position_embeddings": ORIGINAL}},
        CACHE,
    ),
    "llama3": (
        "llama",
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": THETA, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL}},
        CACHE,
    ),
    # Half the head's pairs rotate, the rest stay put (Gemma 4's global layers).
    "proportional": (
        "llama",
        {"rope_parameters": {"rope_type": "proportional", "rope_theta": THETA, "partial_rotary_factor": 0.5, "factor": 1.0}},
        CACHE,
    ),
    # Phi-3 keeps original_max_position_embeddings beside rope_parameters. Exact up to it: the short
    # factors throughout, as eager; a longer cache is refused (below).
    "longrope": (
        "phi3",
        {"max_position_embeddings": 4 * ORIGINAL, "original_max_position_embeddings": ORIGINAL, "rope_parameters": LONGROPE},
        ORIGINAL,
    ),
}
TEXT = "The quick brown fox jumps over the lazy dog. " * 4


def add_preset(monkeypatch, rope_type: str) -> str:
    model_type, overrides, _ = ROPE_TYPES[rope_type]
    name = f"tiny-rope-{rope_type}"
    monkeypatch.setitem(presets.PRESETS, name, (model_type, {**_SMALL, **overrides}))
    return name


def prompts(tokenizer, cache: int) -> list[tuple[list[int], int]]:
    """(prompt ids, new tokens): a short prompt generated to the end of the cache (it crosses
    ORIGINAL while decoding), and a prompt that crosses it itself, then 40 tokens."""
    ids = tokenizer(TEXT).input_ids
    return [(ids[:21], cache - 21), (ids[: cache - 40], 40)]


def test_every_rope_type_of_transformers_is_here():
    """A rope type a later transformers adds fails here until it has its case."""
    assert set(ROPE_TYPES) == {"default", *ROPE_INIT_FUNCTIONS}


@pytest.mark.parametrize("target", ["executorch", "onnx"])
@pytest.mark.parametrize("rope_type", sorted(ROPE_TYPES))
def test_the_rope_type_is_exact_past_its_switch_point(rope_type, target, tmp_path, monkeypatch):
    name = add_preset(monkeypatch, rope_type)
    cache = ROPE_TYPES[rope_type][2]
    model, tokenizer = presets.build_preset(name)
    export_model(ExportOptions(name, target, tmp_path / "out", cache), Progress(quiet=True))
    program = load_program(tmp_path / "out")
    for ids, new_tokens in prompts(tokenizer, cache):
        expected = eager_reference(model, ids, new_tokens)  # transformers' own generate
        got = greedy_with(program.forward, ids, new_tokens)
        assert_generation_matches(got, expected, FP32_LOGIT_ATOL, f"{rope_type} on {target}, {len(ids)}-token prompt")


def test_longrope_past_its_original_length_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    from kvexport.exporter import pipeline

    name = add_preset(monkeypatch, "longrope")
    monkeypatch.setattr(pipeline.sources, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, "export", name, "-o", tmp_path / "out", "--max-cache-len", ORIGINAL + 1)
    assert_one_line_error(code, err, "rope type 'longrope'", f"cache of {ORIGINAL + 1} positions",
                          f"original_max_position_embeddings ({ORIGINAL})", f"--max-cache-len {ORIGINAL} or less")
    assert snapshot(tmp_path) == before


def test_a_longrope_model_s_default_cache_stops_at_its_original_length(tmp_path, monkeypatch):
    """Left to its default (the model's max positions, 4 x ORIGINAL here), the cache is what the rope
    type computes exactly, not a refusal."""
    from kvexport.exporter.pipeline import plan_export

    name = add_preset(monkeypatch, "longrope")
    assert presets.preset_config(name).max_position_embeddings == 4 * ORIGINAL
    assert plan_export(ExportOptions(name, "onnx", tmp_path / "out")).max_cache_len == ORIGINAL


def test_dynamic_past_max_positions_is_refused():
    # Unreachable from export (--max-cache-len is at most max_position_embeddings); the wrapper checks too.
    config = presets.tiny_config("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": THETA, "factor": 4.0}})
    check_rope(config, config.max_position_embeddings)
    with pytest.raises(UnsupportedModelError, match=r"rope type 'dynamic'.*max_position_embeddings \(512\)"):
        check_rope(config, config.max_position_embeddings + 1)


def test_rope_parameters_per_layer_type_are_each_checked():
    config = presets.preset_config("tiny-gemma3")  # global and local rope parameters
    assert {"full_attention", "sliding_attention"} <= set(config.rope_parameters)
    check_rope(config, 64)
    config.rope_parameters["full_attention"] = dict(LONGROPE)
    with pytest.raises(UnsupportedModelError, match="longrope"):
        check_rope(config, ORIGINAL + 1)


def test_a_rotation_that_depends_on_the_call_keeps_its_own_onnx_nodes(tmp_path, monkeypatch):
    """The ONNX target folds a full-attention layer's rotation into its attention node with tables by
    position, computed once; a rotation that changes with the call (longrope's per-call switch,
    here left unfixed on a Llama, whose generation does not recompute the cache) is not folded, and
    the graph then follows eager's per-call switch exactly."""
    import onnx

    from kvexport.exporter import decoder, pipeline

    monkeypatch.setitem(presets.PRESETS, "tiny-llama-longrope", ("llama", {**_SMALL, "rope_parameters": LONGROPE}))
    for module in (pipeline.architecture, decoder):
        monkeypatch.setattr(module, "check_rope", lambda *a: None)
    monkeypatch.setattr(decoder, "fixed_rotary_frequencies", lambda *a: None)
    model, tokenizer = presets.build_preset("tiny-llama-longrope")
    export_model(ExportOptions("tiny-llama-longrope", "onnx", tmp_path / "out", 96), Progress(quiet=True))
    graph = onnx.load(str(tmp_path / "out" / "model.onnx"), load_external_data=False).graph
    ops = collections.Counter(n.op_type for n in graph.node)
    assert ops["RotaryEmbedding"] == 2 * 2  # a query's and a key's in each layer
    ids = tokenizer(TEXT).input_ids[:21]
    got = greedy_with(load_program(tmp_path / "out").forward, ids, 96 - 21)
    assert_generation_matches(got, eager_reference(model, ids, 96 - 21), FP32_LOGIT_ATOL, "per-call longrope")


def test_a_complex_rotary_embedding_is_rotated_with_real_ops_exactly():
    """Llama 4's complex rotary embedding (``torch.polar``, ``view_as_complex``), which neither target
    runs, as the adapter writes it: the same angles' cos and sin and each interleaved pair rotated
    in real arithmetic, against transformers' own ``apply_rotary_emb``; and the prepared model's
    logits against the model as transformers builds it."""
    import torch
    from transformers.models.llama4 import modeling_llama4

    from kvexport.models.adapters import prepare_for_export, rotate_pairs

    model, _ = presets.build_preset("tiny-llama4")
    reference, _ = presets.build_preset("tiny-llama4")
    positions = torch.arange(40)[None]
    freqs_cis = reference.model.rotary_emb(torch.zeros(1), positions)
    prepare_for_export(model)
    cos_sin = model.model.rotary_emb(torch.zeros(1), positions)
    assert not cos_sin.is_complex() and cos_sin.shape == (1, 40, freqs_cis.shape[-1], 2)
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 40, 4, 16, generator=generator), torch.randn(1, 40, 2, 16, generator=generator)
    expected = modeling_llama4.apply_rotary_emb(q, k, freqs_cis)
    torch.testing.assert_close((rotate_pairs(q, cos_sin), rotate_pairs(k, cos_sin)), expected, atol=1e-6, rtol=1e-6)
    ids = torch.randint(0, 96, (1, 30), generator=generator)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=1e-4, rtol=1e-4)
