"""The options of ``kvexport run`` and ``python -m kvexport.device``, declared once.

argparse, not typer: the device runner imports neither typer nor rich. A mistake is one line
(``InvalidOptionError``), never argparse's usage block. Values are checked where they are used
(``Sampling``, ``check_fits``), before anything loads.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import InvalidOptionError

RUNNERS = ("kvexport", "executorch", "genai")
DEVICES = ("cpu", "cuda")


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise InvalidOptionError(f"{message}; see `{self.prog} --help`")


def run_parser(prog: str) -> OneLineParser:
    parser = OneLineParser(
        prog=prog,
        description="Generate with a kvexport artifact (folder or kvexport pack archive) and its tokenizer "
        "alone (no transformers).",
    )
    parser.add_argument("artifact", type=Path, metavar="DIR|ARCHIVE", help="artifact folder, or archive from kvexport pack")
    parser.add_argument("--prompt", "-p", required=True, metavar="TEXT", help="prompt text")
    parser.add_argument("--max-new-tokens", type=int, metavar="N", help="new tokens [default: until EOS or the cache is full]")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 is greedy [default: 0]")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling threshold [default: 1]")
    parser.add_argument("--seed", type=int, metavar="S", help="sampling seed")
    parser.add_argument("--device", default="cpu", metavar="cpu|cuda", help="cpu or cuda (float16 ONNX artifacts) [default: cpu]")
    parser.add_argument("--runner", choices=RUNNERS, default="kvexport",
                        help="executorch: ExecuTorch's own TextLLMRunner (.pte only); genai: onnxruntime-genai "
                        "(ONNX only) [default: kvexport]")
    parser.add_argument("--draft", metavar="ngram|ARTIFACT",
                        help="speculative decoding (greedy, the same tokens): draft with prompt lookup (ngram) or "
                        "another artifact of the same tokenizer; the artifact must be exported with --max-draft-tokens")
    parser.add_argument("--draft-tokens", type=int, metavar="K",
                        help="with --draft: tokens drafted per verification [default: the artifact's max_draft_tokens]")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--verbose", action="store_true",
                        help="let third-party libraries' log lines (ExecuTorch's native layer) through")
    return parser


def parse_run_args(argv: list[str], prog: str) -> argparse.Namespace:
    return run_parser(prog).parse_args(argv)
