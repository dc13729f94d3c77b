"""``custom_op_cache``: the calls its programs make to ExecuTorch's ``llama::custom_sdpa``.
(That its caches attend as eager does: tests/exporter/test_kv_cache.py and the .pte tests.)"""

from __future__ import annotations

import pytest
import torch

from kvexport.exporter.decoder import ExportableDecoder, export_decoder, export_verifier
from kvexport.exporter.executorch.custom_op_cache import CUSTOM_OP_CACHES, custom_op_caches
from kvexport.models.presets import build_preset
from kvexport.runtime.programs import load_program

from tests.conftest import NEW_TOKENS, TEST_CACHE_LEN
from tests.helpers import FP32_LOGIT_ATOL, assert_generation_matches, eager_reference, greedy_with

DRAFTS = 4


def sdpa_calls(graph: torch.fx.Graph) -> list[tuple]:
    """``(query rows, query heads, causal)`` of each ``custom_sdpa`` call in ``graph`` (rows: a
    number, or the call length's expression)."""
    calls = []
    for node in graph.nodes:
        if node.target == torch.ops.llama.custom_sdpa.default:
            _, rows, heads, _ = node.args[0].meta["val"].shape
            calls.append((rows, heads, node.args[6]))
    return calls


def cond_branches(program: torch.export.ExportedProgram) -> list[tuple[torch.fx.Graph, torch.fx.Graph]]:
    """The (true, false) graphs of each ``torch.cond`` in ``program``."""
    module = program.graph_module
    conds = [n for n in program.graph.nodes if n.target == torch.ops.higher_order.cond]
    return [(getattr(module, n.args[1].target).graph, getattr(module, n.args[2].target).graph) for n in conds]


def call_tokens(program: torch.export.ExportedProgram):
    return next(n for n in program.graph.nodes if n.op == "placeholder" and n.name == "tokens").meta["val"].shape[1]


@pytest.mark.parametrize("preset, causal", [("tiny-llama", True), ("tiny-mistral", False)], ids=["static", "ring-with-mask"])
def test_a_decode_step_reads_each_kv_head_once_for_its_group(preset, causal):
    """Layers with query-head groups: a one-token call stacks each group's query heads as the rows
    of one query over its KV head (each cached row read once a step, not once per query head);
    longer calls go row by row with one extra row, so that no call is a one-row product (several
    times slower: docs/performance.md#attention-in-a-pte); a verification, of any length up to
    ``K + 1``, likewise. A static buffer's calls are causal, a ring's masked."""
    model, _ = build_preset(preset)
    config = model.config
    heads, kv_heads, layers = config.num_attention_heads, config.num_key_value_heads, config.num_hidden_layers
    assert heads > kv_heads
    decoder = ExportableDecoder(model, TEST_CACHE_LEN, CUSTOM_OP_CACHES, spare_slots=DRAFTS)

    for program in (export_decoder(decoder), export_verifier(decoder, DRAFTS + 1)):
        assert sdpa_calls(program.graph) == []
        branches = cond_branches(program)
        assert len(branches) == layers
        for one_token, longer in branches:
            assert sdpa_calls(one_token) == [(heads // kv_heads, kv_heads, False)]
            [(rows, h, is_causal)] = sdpa_calls(longer)
            assert (h, is_causal) == (heads, causal) and str(rows) == str(call_tokens(program) + 1)


@pytest.mark.parametrize("preset, causal", [("tiny-llama", True), ("tiny-mistral", False)], ids=["static", "ring-with-mask"])
def test_per_head_calls_are_the_kernels_own(preset, causal):
    """``--sdpa-query per-head``: every call, a decode step's too, is one ``custom_sdpa`` of the
    call's rows over every query head, as ExecuTorch's own recipes call it: no branch on the call's
    length, no extra row, and a verification one call of its rows (up to ``K + 1``) per layer."""
    model, _ = build_preset(preset)
    heads, layers = model.config.num_attention_heads, model.config.num_hidden_layers
    decoder = ExportableDecoder(model, TEST_CACHE_LEN, custom_op_caches(grouped=False), spare_slots=DRAFTS)

    for program in (export_decoder(decoder), export_verifier(decoder, DRAFTS + 1)):
        assert cond_branches(program) == [] and isinstance(call_tokens(program), torch.SymInt)
        calls = sdpa_calls(program.graph)
        assert [(str(rows), h, c) for rows, h, c in calls] == [(str(call_tokens(program)), heads, causal)] * layers


@pytest.mark.parametrize("sdpa_query", ["grouped", "per-head"])
@pytest.mark.parametrize("prompt_tokens", [1, 2, 5])
def test_decode_from_the_first_positions_matches_eager(artifact, prompt_tokens, sdpa_query):
    """Either form from the shortest prompts equals eager's; the stacked call's start lies before
    position 0 while the filled length is under a group (the kernel reads ``[0, start + group)``)."""
    model, tokenizer = build_preset("tiny-llama")
    ids = tokenizer("The quick brown fox jumps over the lazy dog").input_ids[:prompt_tokens]
    assert len(ids) == prompt_tokens
    program = load_program(artifact("tiny-llama", sdpa_query=sdpa_query))
    got = greedy_with(program.forward, ids, NEW_TOKENS)
    assert_generation_matches(got, eager_reference(model, ids, NEW_TOKENS), FP32_LOGIT_ATOL, f"{prompt_tokens}-token prompt")
