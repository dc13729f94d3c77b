"""``python -m kvexport.device ARTIFACT --prompt TEXT``: generate on the machine that runs the artifact.

ARTIFACT is an artifact folder or an archive from ``kvexport pack``; every file is checked against
its sha256 in ``kvexport.json`` before anything loads. It is ``kvexport run`` (same options, same
sampling, EOS and cache-length rules, same ``--json`` fields), but this module imports neither
transformers nor torch for an ONNX artifact (onnxruntime, numpy and tokenizers only, jinja2 for
``--chat``), nor typer or rich; a ``.pte`` needs ExecuTorch's Python runtime, which brings torch.
``--runner executorch`` runs a ``.pte`` with ExecuTorch's own C++ LLM runner instead.
"""

from __future__ import annotations

import sys

from . import logs
from .errors import KvexportError
from .runtime.run import run_main

PROG = "python -m kvexport.device"


def main(argv: list[str] | None = None) -> int:
    logs.quiet()
    try:
        run_main(sys.argv[1:] if argv is None else argv, PROG)
    except KvexportError as e:
        print(f"kvexport: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("kvexport: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
