"""scripts/simulate_kv_cache.py on a tiny preset: the unrounded scheme reproduces the reference pass
exactly, and each int8 scheme moves the logits."""

from __future__ import annotations

import re

from tests.helpers import load_script


def test_the_simulation_moves_the_logits_only_where_it_rounds(tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The lighthouse keeper wrote in her log every evening, and the sea was rough.\n")
    args = ["tiny-qwen3", str(prompt), "--steps", "8", "--max-cache-len", "64", "--schemes", "float", "executorch", "onnx"]
    assert load_script("simulate_kv_cache").main(args) == 0
    lines = {m[1]: m for m in re.finditer(r"^\s*(\w+): top-1 agreement .*every position: ([\d.]+)%, mean KL ([-\d.e+]+)$",
                                          capsys.readouterr().out, re.M)}  # fmt: skip
    assert set(lines) == {"float", "executorch", "onnx"}
    assert float(lines["float"][2]) == 100.0 and float(lines["float"][3]) == 0.0
    assert float(lines["executorch"][3]) > 0 and float(lines["onnx"][3]) > 0
