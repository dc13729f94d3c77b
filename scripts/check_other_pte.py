#!/usr/bin/env python3
"""Top-1 agreement of another exporter's ``.pte`` with float eager, measured as ``kvexport check``
measures a quantized kvexport artifact.

    python scripts/check_other_pte.py ARTIFACT OTHER.pte [--json OUT.json]

ARTIFACT is a kvexport artifact of the same model: its tokenizer, default prompts, EOS ids and
eager reference are used, so both programs are held to the same teacher-forced steps (256 on the
short prompt, 32 on the long one, EOS never fed; ``kvexport.checker.check``). OTHER.pte is
driven the way ExecuTorch's TextLLMRunner drives a program: ``forward(tokens[1, T], positions)``,
where positions is ``[start]`` or one per token as the program's second input is shaped, in calls
of at most its first input's length; a ``.ptd`` of the same name beside it is its data file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if (REPO / "kvexport").is_dir() and str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # this checkout's kvexport, not another installed one


class OtherProgram:
    """``forward(tokens, start) -> logits`` over a ``.pte`` that is not kvexport's."""

    def __init__(self, pte: Path, manifest):
        from executorch.runtime import Runtime

        from kvexport.runtime.executorch_program import register_kernels

        register_kernels()
        data = pte.with_suffix(".ptd")
        self.manifest = manifest  # the kvexport artifact's: check_fits reads max_cache_len
        self._method = Runtime.get().load_program(pte, data_path=data if data.is_file() else None).load_method("forward")
        meta = self._method.metadata
        self._chunk = meta.input_tensor_meta(0).sizes()[-1]
        self._per_token = meta.input_tensor_meta(1).sizes()[0] > 1

    def forward(self, tokens: list[int], start: int):
        import torch

        for first in range(0, len(tokens), self._chunk):
            chunk = tokens[first : first + self._chunk]
            at = start + first
            positions = torch.arange(at, at + len(chunk)) if self._per_token else torch.tensor([at])
            logits = self._method.execute([torch.tensor([chunk]), positions])[0]
        return logits.reshape(-1, logits.shape[-1])[-1].float().numpy().copy()

    def reset(self) -> None:
        pass


def measure(artifact: Path, pte: Path) -> list[dict]:
    from kvexport.artifact.manifest import read_manifest
    from kvexport.checker import check
    from kvexport.runtime.tokenizer import ArtifactTokenizer

    manifest = read_manifest(artifact)
    tokenizer = ArtifactTokenizer(artifact)
    program = OtherProgram(pte, manifest)
    model = check.load_reference(manifest, None, "cpu")
    rows = []
    for text, steps in check.default_prompts(manifest, tokenizer, check.QUANTIZED_STEPS):
        report = check.check_prompt(program, model, tokenizer.encode(text), steps, check.LOGIT_TOLERANCE["float32"],
                                    teacher_forcing=True, suppress=manifest.eos_token_ids)
        margins = report.disagreement_margins
        rows.append({"prompt_tokens": report.prompt_tokens, "steps": report.compared_steps,
                     "top1_agreement": report.top1_agreement, "max_logit_diff": report.max_logit_diff,
                     "median_disagreement_margin": statistics.median(margins) if margins else None})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path, help="a kvexport artifact of the same model")
    parser.add_argument("pte", type=Path, help="the other exporter's .pte")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not args.pte.is_file():
        parser.error(f"{args.pte}: no such file")
    rows = measure(args.artifact, args.pte)
    for row in rows:
        print(f"{row['prompt_tokens']}-token prompt: top-1 agreement {row['top1_agreement']:.1%} over "
              f"{row['steps']} teacher-forced steps, max |logit diff| {row['max_logit_diff']:.3g}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
