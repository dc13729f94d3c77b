"""ExecuTorch target: XNNPACK-delegated ``model.pte`` with the metadata ExecuTorch's LLM runner reads."""

from __future__ import annotations

from pathlib import Path

import torch

from ..export import export_decoder as export  # noqa: F401
from ..wrapper import ExportableDecoder as decoder  # noqa: F401  (the cache lives in mutable buffers)

PROGRAM_FILE = "model.pte"
SUPPORTED_DTYPES = ("float32", "float16")
RUNTIME_PACKAGES = ("executorch",)


def _constant_methods(info: dict) -> dict:
    """Metadata methods of the ``.pte``, named and meant as ExecuTorch's ``llm_runner_helper`` reads them."""
    methods = {
        "get_max_seq_len": info["max_cache_len"],  # most tokens one forward call takes (the prefill chunk)
        "get_max_context_len": info["max_cache_len"],
        "use_kv_cache": True,
        "use_sdpa_with_kv_cache": False,
        "enable_dynamic_shape": True,
        "get_eos_ids": info["eos_token_ids"],
        "get_vocab_size": info["vocab_size"],
        "get_n_layers": len(info["layers"]),
    }
    if info.get("bos_token_id") is not None:
        methods["get_bos_id"] = info["bos_token_id"]
    return methods


def lower(program: torch.export.ExportedProgram, info: dict, out_dir: Path) -> dict:
    """Lower to XNNPACK and write ``model.pte``; return facts for ``kvexport.json``."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.passes.sym_shape_eval_pass import ConstraintBasedSymShapeEvalPass

    edge = to_edge_transform_and_lower(
        program,
        partitioner=[XnnpackPartitioner()],
        compile_config=EdgeCompileConfig(_check_ir_validity=False),
        constant_methods=_constant_methods(info),
    )
    delegated, portable = _op_counts(edge.exported_program().graph_module)
    et_program = edge.to_executorch(
        ExecutorchBackendConfig(
            extract_delegate_segments=True,
            memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False),
            # Plan activation memory for the largest call (T = max_cache_len), not the example input.
            sym_shape_eval_pass=ConstraintBasedSymShapeEvalPass(),
        )
    )
    path = out_dir / PROGRAM_FILE
    with open(path, "wb") as f:
        et_program.write_to_file(f)
    return {"program": PROGRAM_FILE, "delegated_calls": delegated, "non_delegated_ops": portable}


def _op_counts(graph_module: torch.fx.GraphModule) -> tuple[int, int]:
    """XNNPACK delegate calls, and ops left outside the delegate (run by portable kernels)."""
    delegated = portable = 0
    for node in graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        name = getattr(node.target, "__name__", str(node.target))
        if "executorch_call_delegate" in name:
            delegated += 1
        elif name != "getitem":
            portable += 1
    return delegated, portable
