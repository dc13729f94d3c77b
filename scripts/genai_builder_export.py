"""onnxruntime-genai's own model builder on a kvexport model, for comparison (issue 36's baseline):
``python -m onnxruntime_genai.models.builder`` with the model saved as a Hugging Face folder first
(the builder reads safetensors, not GGUF). Not part of kvexport; nothing in kvexport calls it.

    python scripts/genai_builder_export.py MODEL OUT_DIR [-p fp32|int4] [--work DIR]

Gemma 3 under transformers 5: the builder of onnxruntime-genai 0.18 reads a Gemma 3 config's
``rope_parameters["rope_type"]``, ``rope_theta`` and ``rope_local_base_freq`` (the layout before
transformers moved them under ``rope_parameters[layer_type]``); they are set on the loaded config
from the per-layer-type values before it runs, which changes nothing else.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _old_gemma3_fields(config):
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and "sliding_attention" in rope and "rope_type" not in rope:
        full, local = rope["full_attention"], rope["sliding_attention"]
        config.rope_parameters = {**rope, "rope_type": full["rope_type"], "rope_theta": full["rope_theta"]}
        config.rope_theta, config.rope_local_base_freq = full["rope_theta"], local["rope_theta"]
    for sub in ("text_config",):
        if hasattr(config, sub):
            _old_gemma3_fields(getattr(config, sub))
    return config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="kvexport MODEL (alias, preset, folder, .gguf)")
    parser.add_argument("out", type=Path)
    parser.add_argument("-p", "--precision", default="fp32", choices=("fp32", "int4"))
    parser.add_argument("--work", type=Path, default=Path("build/genai-builder-work"))
    args = parser.parse_args()

    from transformers import AutoConfig

    from kvexport.models import sources

    hf = args.work / "hf"
    if not (hf / "config.json").is_file():
        model, tokenizer = sources.load_model(sources.resolve(args.model), "float32")
        model.save_pretrained(hf)
        tokenizer.save_pretrained(hf)
        del model
    original = AutoConfig.from_pretrained.__func__
    AutoConfig.from_pretrained = classmethod(lambda cls, *a, **k: _old_gemma3_fields(original(cls, *a, **k)))
    sys.argv = ["builder", "-i", str(hf), "-o", str(args.out), "-p", args.precision, "-e", "cpu", "-c", str(args.work / "cache")]
    runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
