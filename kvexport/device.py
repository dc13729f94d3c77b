"""``python -m kvexport.device ARTIFACT --prompt TEXT``: generate on the machine that runs the artifact.

ARTIFACT is an artifact folder or an archive from ``kvexport pack``; every file is checked against
its sha256 in ``kvexport.json`` before anything loads. It is ``kvexport run`` (same options, same
sampling, EOS and cache-length rules, same ``--json`` fields), but this module imports neither
transformers nor torch for an ONNX artifact (onnxruntime, numpy and tokenizers only, jinja2 for
``--chat``), nor typer or rich; a ``.pte`` needs ExecuTorch's Python runtime, which brings torch.
``--runner executorch`` runs a ``.pte`` with ExecuTorch's own C++ LLM runner instead.
"""

from __future__ import annotations

import signal
import sys
import threading

from . import logs
from .errors import Interrupted, KvexportError
from .runtime.run import run_main

PROG = "python -m kvexport.device"


def _interrupt(signum, frame):
    raise Interrupted(signum)


def main(argv: list[str] | None = None) -> int:
    logs.quiet()
    # SIGTERM (a service manager, a timeout) and Ctrl-C unwind like an exception, so an archive's
    # unpacked copy in the temporary folder is removed; exit 143 / 130 with one line, as kvexport's.
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.getsignal(s) for s in signals} if threading.current_thread() is threading.main_thread() else {}
    if None in previous.values():  # handlers set outside Python cannot be given back
        previous = {}
    if previous:
        signal.signal(signal.SIGTERM, _interrupt)
        if previous[signal.SIGINT] is signal.default_int_handler:  # not where a shell set it to be ignored
            signal.signal(signal.SIGINT, _interrupt)
    try:
        run_main(sys.argv[1:] if argv is None else argv, PROG)
    except KvexportError as e:
        print(f"kvexport: error: {e}", file=sys.stderr)
        return e.exit_code
    except Interrupted as e:
        print(f"kvexport: {'terminated (SIGTERM)' if e.signum == signal.SIGTERM else 'interrupted'}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("kvexport: interrupted", file=sys.stderr)
        return 130
    finally:  # main() also runs inside other programs (the tests): give their handlers back
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
