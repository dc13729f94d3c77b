"""scripts/onnx_decode_profile.py on a tiny int4 folder: a step's time by module and by operation,
the exact scheme's offset nodes and its 4-bit and 8-bit products apart."""

from __future__ import annotations

from tests.helpers import load_script


def test_a_step_is_split_by_module_and_by_operation(artifact):
    folder = artifact("tiny-llama", "onnx", quantize="int4")
    script = load_script("onnx_decode_profile")
    for by, kinds in [("module", {"self_attn", "mlp"}), ("op", {"MatMulNBits 4-bit", "MatMulNBits 8-bit", "offsets"})]:
        step = script.profile(folder, position=8, steps=2, threads=1, by=by)
        wall = step.pop("step (wall)")
        assert kinds <= set(step) and all(step[kind] > 0 for kind in kinds), step
        assert 0 < sum(step.values()) <= wall * 1.05  # kernels within the run (ONNX Runtime's own overhead aside)
