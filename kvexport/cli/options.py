"""Options that several commands share: their types and help texts, declared once."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ..errors import InvalidOptionError

JsonFlag = Annotated[bool, typer.Option("--json", help="print one JSON object on stdout")]
DraftTokens = Annotated[
    Optional[int], typer.Option(metavar="K", help="with --draft: tokens drafted per verification [default: the artifact's max_draft_tokens]")
]


GENAI_RUNNER_HELP = "what runs the artifact: kvexport's runner, or onnxruntime-genai (ONNX artifacts)"


def check_runner(runner: str) -> None:
    if runner not in ("kvexport", "genai"):
        raise InvalidOptionError(f"unknown --runner '{runner}'; choose kvexport or genai")
