"""XNNPACK's passes run only where they can change a partition, and the program is the same."""

from __future__ import annotations

import hashlib

from executorch.backends.xnnpack import _passes as xnnpack_passes
from executorch.backends.xnnpack.partition.graphs import bilinear_2d, sdpa

from kvexport.exporter.executorch import xnnpack_passes as only_applying
from kvexport.exporter.pipeline import ExportOptions, export_model
from kvexport.progress import Progress

from tests.conftest import TEST_CACHE_LEN


def test_every_pattern_a_skipped_matching_pass_looks_for_holds_its_operator():
    """The subgraph-matching passes are left out where an operator every one of their patterns holds
    is absent: a pattern without it would make that unsafe."""
    for pass_, patterns in ((xnnpack_passes.ConvertToSDPAPass, sdpa.get_graphs()),
                            (xnnpack_passes.ConvertToUpsampleBilinear2d, list(bilinear_2d.get_graphs_dict()))):
        needed = only_applying.PASS_NEEDS[pass_]
        for pattern in patterns:
            assert needed & {node.target for node in pattern.graph.nodes}, pass_.__name__


def test_the_passes_that_apply_are_xnnpack_s_in_its_order():
    all_passes = xnnpack_passes.XNNPACKPassManager(exported_program=None).passes
    assert set(only_applying.PASS_NEEDS) <= set(all_passes)

    class Graph:  # a partition with a batch norm and nothing else the filter knows
        nodes = [type("Node", (), {"op": "call_function", "target": next(iter(only_applying.PASS_NEEDS[xnnpack_passes.FuseBatchNormPass]))})]

    kept = only_applying.passes_that_apply(all_passes, Graph)
    assert kept == [p for p in all_passes if p not in only_applying.PASS_NEEDS
                    or p in (xnnpack_passes.FuseBatchNormPass, xnnpack_passes.DecomposeBatchNorm)]


def test_leaving_out_the_passes_that_cannot_apply_gives_the_same_program(artifact, tmp_path, monkeypatch):
    """Tiny Mistral (sliding rings through custom ops, several partitions a layer; no set-ordered
    tables, so its bytes do not follow the hash seed): the same .pte and .ptd bytes with every XNNPACK
    pass run on every partition as the session's artifact, lowered with the filter."""
    filtered = artifact("tiny-mistral")
    monkeypatch.setattr(only_applying, "PASS_NEEDS", {})
    every_pass = tmp_path / "every-pass"
    export_model(ExportOptions("tiny-mistral", "executorch", every_pass, TEST_CACHE_LEN), Progress(quiet=True))
    for name in ("model.pte", "model.ptd"):
        assert sha256(every_pass / name) == sha256(filtered / name), name


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
