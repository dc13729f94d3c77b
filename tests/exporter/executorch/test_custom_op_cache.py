"""``custom_op_cache``: the calls its programs make to ExecuTorch's ``llama::custom_sdpa``.
(That its caches attend as eager does: tests/exporter/test_kv_cache.py and the .pte tests.)"""

from __future__ import annotations

import pytest
import torch

from kvexport.exporter.decoder import ExportableDecoder, export_decoder, export_verifier
from kvexport.exporter.executorch.custom_op_cache import CUSTOM_OP_CACHES
from kvexport.models.presets import build_preset

from tests.conftest import TEST_CACHE_LEN

DRAFTS = 4


def sdpa_query_rows(program: torch.export.ExportedProgram) -> list:
    """The query rows (a number, or the call length's expression) of each ``custom_sdpa`` call."""
    return [node.args[0].meta["val"].shape[1] for node in program.graph.nodes if node.target == torch.ops.llama.custom_sdpa.default]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mistral"], ids=["causal", "ring-with-mask"])
def test_custom_sdpa_is_given_one_query_row_more_than_the_call(preset):
    """Every kernel call gets the call's query rows and one more, so a decode step is never a
    one-row product (several times slower: docs/performance.md#attention-in-a-pte), and a
    verification of ``K`` drafts is one kernel call of ``K + 2`` rows per layer."""
    model, _ = build_preset(preset)
    decoder = ExportableDecoder(model, TEST_CACHE_LEN, CUSTOM_OP_CACHES, spare_slots=DRAFTS)
    layers = model.config.num_hidden_layers

    forward = export_decoder(decoder)
    tokens = next(n for n in forward.graph.nodes if n.op == "placeholder" and n.name == "tokens").meta["val"].shape[1]
    rows = sdpa_query_rows(forward)
    assert len(rows) == layers
    assert {str(r) for r in rows} == {str(tokens + 1)}

    assert sdpa_query_rows(export_verifier(decoder, DRAFTS + 1)) == [DRAFTS + 2] * layers
