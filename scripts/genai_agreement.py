"""Top-1 agreement with float32 eager transformers of ONNX folders run by onnxruntime-genai: a kvexport
ONNX artifact and other exporters' genai folders of the same model (onnxruntime-genai's own model
builder's, say), measured as ``kvexport check`` measures a quantized artifact (eager's tokens fed to
every folder, each step's top-1 compared with eager's, EOS never picked, max |logit diff| reported).
A comparison, not a test: the other folders are made elsewhere (docs/performance.md#onnxruntime-genai).

    python scripts/genai_agreement.py MODEL KVEXPORT_ONNX_DIR [OTHER_GENAI_DIR ...] [--steps 256]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # this checkout's kvexport


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="the float32 eager reference (alias, preset, folder, .gguf)")
    parser.add_argument("artifact", type=Path, help="kvexport ONNX artifact: its prompts and tokenizer are used")
    parser.add_argument("others", type=Path, nargs="*", help="other exporters' genai folders of the model")
    parser.add_argument("--steps", type=int, default=256, help="teacher-forced steps per prompt")
    args = parser.parse_args()

    from kvexport.artifact.manifest import read_manifest
    from kvexport.checker.check import LOGIT_TOLERANCE, check_prompt, default_prompts, load_reference
    from kvexport.runtime.genai_program import GenaiProgram
    from kvexport.runtime.tokenizer import ArtifactTokenizer

    manifest = read_manifest(args.artifact)
    tokenizer = ArtifactTokenizer(args.artifact)
    model = load_reference(manifest, args.model, "cpu", "float32")
    prompts = [(text, tokenizer.encode(text)) for text, _ in default_prompts(manifest, tokenizer, args.steps)]
    folders = [args.artifact, *args.others]
    results = []
    for folder in folders:
        config = json.loads((folder / "genai_config.json").read_text())
        # What GenaiProgram reads of a manifest: the target, the generation's max_length (the kvexport
        # artifact's cache for every folder), the vocabulary; no file list, since another exporter's
        # folder has no kvexport.json to verify it against.
        fields = dataclasses.replace(manifest, genai_config="genai_config.json", files={}, versions={},
                                     max_cache_len=min(manifest.max_cache_len, config["search"]["max_length"]))
        program = GenaiProgram(folder, fields, "cpu")
        for text, ids in prompts:
            steps = min(args.steps, fields.max_cache_len - len(ids))
            report = check_prompt(program, model, ids, steps, LOGIT_TOLERANCE["float32"], teacher_forcing=True,
                                  suppress=manifest.eos_token_ids)
            results.append({"folder": str(folder), "prompt_tokens": len(ids), "steps": report.compared_steps,
                            "top1_agreement": report.top1_agreement, "max_logit_diff": report.max_logit_diff})
            print(f"{folder}: {len(ids)}-token prompt, {report.compared_steps} steps: top-1 agreement "
                  f"{report.top1_agreement:.1%}, max |logit diff| {report.max_logit_diff:.3g}", flush=True)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
