"""The ``kvexport`` command. ``kvexport MODEL --target T`` is short for ``kvexport export MODEL --target T``."""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from .. import logs
from ..api import EXPORT_HASH_SEED
from ..errors import Interrupted, KvexportError
from ..exporter.options import help_text
from . import bench, chat, check, matrix
from .options import JsonFlag

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    # Help texts are plain: rich markup would swallow their "[default: ...]" notes.
    rich_markup_mode=None,
    help="Export Hugging Face decoder LLMs to ExecuTorch / ONNX with an export-safe KV cache, "
    "and prove the artifact generates what eager transformers generates. "
    "Any command takes --verbose: third-party libraries' log lines and progress bars are then let through.",
)


# The export options' help texts are ExportOptions' (exporter/options.py), where each is declared with its
# type and default; their values stay strings here, and ExportOptions turns them into its enums, refusing
# an unknown one with the same line the API and a matrix file get.
@app.command()
def export(
    model: Annotated[str, typer.Argument(help=help_text("model"))],
    target: Annotated[str, typer.Option("--target", "-t", help=help_text("target"))] = "executorch",
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help=help_text("out"))] = None,
    max_cache_len: Annotated[Optional[int], typer.Option(help=help_text("max_cache_len"))] = None,
    prefill_chunk: Annotated[Optional[int], typer.Option(help=help_text("prefill_chunk"))] = None,
    dtype: Annotated[str, typer.Option(help=help_text("dtype"))] = "float32",
    force: Annotated[bool, typer.Option("--force", help=help_text("force"))] = False,
    quantize: Annotated[Optional[str], typer.Option(help=help_text("quantize"))] = None,
    quantize_embedding: Annotated[Optional[str], typer.Option(help=help_text("quantize_embedding"))] = None,
    quantize_lm_head: Annotated[Optional[str], typer.Option(help=help_text("quantize_lm_head"))] = None,
    quantize_grid: Annotated[Optional[str], typer.Option(help=help_text("quantize_grid"))] = None,
    kv_cache: Annotated[str, typer.Option(help=help_text("kv_cache"))] = "float",
    sdpa_query: Annotated[str, typer.Option(help=help_text("sdpa_query"))] = "auto",
    int8_kv_sdpa: Annotated[str, typer.Option(help=help_text("int8_kv_sdpa"))] = "auto",
    decode_attention: Annotated[str, typer.Option(help=help_text("decode_attention"))] = "custom-sdpa",
    max_draft_tokens: Annotated[int, typer.Option(help=help_text("max_draft_tokens"))] = 0,
    revision: Annotated[Optional[str], typer.Option(help=help_text("revision"))] = None,
    offline: Annotated[bool, typer.Option("--offline", help=help_text("offline"))] = False,
    gguf_file: Annotated[Optional[str], typer.Option(help=help_text("gguf_file"))] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress output")] = False,
    profile: Annotated[
        Optional[Path],
        typer.Option(help="write the functions the export spent its time in to this file (cProfile; FILE.prof beside it)"),
    ] = None,
    as_json: JsonFlag = False,
):
    """Export MODEL to an artifact folder (program, tokenizer, kvexport.json)."""
    from ..api import export_in_this_process  # main() gave this process kvexport's hash seed
    from ..profile import profiled

    with profiled(profile):
        result = export_in_this_process(
            model, target, out, quiet=quiet, max_cache_len=max_cache_len, dtype=dtype, force=force, quantize=quantize,
            quantize_embedding=quantize_embedding, quantize_lm_head=quantize_lm_head,
            quantize_grid=quantize_grid, prefill_chunk=prefill_chunk,
            kv_cache=kv_cache, sdpa_query=sdpa_query, int8_kv_sdpa=int8_kv_sdpa, decode_attention=decode_attention,
            max_draft_tokens=max_draft_tokens, revision=revision, offline=offline, gguf_file=gguf_file,
        )
    if as_json:
        print(json.dumps({"folder": str(result.folder), "seconds": result.seconds, "peak_rss_mb": result.peak_rss_mb}))


# run's options are declared once, in runtime/options.py, for this command and the device runner.
@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def run(ctx: typer.Context):
    """Generate with the artifact (folder or kvexport pack archive) and its tokenizer alone (no transformers model)."""
    from ..runtime.run import run_main

    run_main(ctx.args, "kvexport run")


app.command("chat")(chat.chat_command)


@app.command()
def pack(
    folder: Annotated[Path, typer.Argument(help="artifact folder")],
    out: Annotated[
        Optional[Path], typer.Option("--out", "-o", help="archive [default: FOLDER.tar; a .tar.gz or .tgz name is gzipped]")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="replace an existing archive")] = False,
    as_json: JsonFlag = False,
):
    """Write the artifact folder as one archive for a device; its files are verified first, and again where it runs."""
    from ..artifact.archive import pack as pack_folder

    archive, sha256 = pack_folder(folder, out, force)
    if as_json:
        print(json.dumps({"archive": str(archive), "sha256": sha256, "bytes": archive.stat().st_size}))
    else:  # sha256sum's format: `sha256sum -c` checks the copy on the device
        print(f"{sha256}  {archive}")


app.command("check")(check.check_command)
app.command("matrix")(matrix.matrix_command)
app.command("bench")(bench.bench_command)


def _interrupt(signum, frame):
    raise Interrupted(signum)


def _reexec_with_fixed_hash_seed(argv: list[str]) -> None:
    if os.environ.get("PYTHONHASHSEED") == EXPORT_HASH_SEED:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    env = {**os.environ, "PYTHONHASHSEED": EXPORT_HASH_SEED}
    os.execve(sys.executable, [sys.executable, "-m", "kvexport.cli", *argv], env)


def main(argv: list[str] | None = None) -> None:
    in_own_process = argv is None  # not called from another program (the tests), which exec would replace
    argv = list(sys.argv[1:] if argv is None else argv)
    options = argv[: argv.index("--")] if "--" in argv else argv
    if "--verbose" in options:
        argv.remove("--verbose")
        os.environ[logs.VERBOSE_ENV] = "1"
    commands = {c.name or c.callback.__name__ for c in app.registered_commands}
    if argv and not argv[0].startswith("-") and argv[0] not in commands:
        argv.insert(0, "export")
    if in_own_process and argv[:1] == ["export"] and "--help" not in argv:
        _reexec_with_fixed_hash_seed(argv)
    logs.quiet()
    import click

    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, _interrupt)
    if previous[signal.SIGINT] is signal.default_int_handler:  # not where a shell set it to be ignored
        signal.signal(signal.SIGINT, _interrupt)
    try:
        rc = app(args=argv, prog_name="kvexport", standalone_mode=False)
    except KvexportError as e:
        print(f"kvexport: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except Interrupted as e:
        # The shell's convention, 128 + the signal: 130 for Ctrl-C (SIGINT), 143 for SIGTERM.
        what = "terminated (SIGTERM)" if e.signum == signal.SIGTERM else "interrupted"
        print(f"kvexport: {what}; no partial output was left behind", file=sys.stderr)
        sys.exit(128 + e.signum)
    except (KeyboardInterrupt, typer.Abort, click.exceptions.Abort):
        print("kvexport: interrupted; no partial output was left behind", file=sys.stderr)
        sys.exit(130)
    except (typer.Exit, click.exceptions.Exit) as e:
        sys.exit(e.exit_code)
    # Usage errors: an unknown option, a missing argument, a value of the wrong type. typer 0.29
    # raises its own copy of click's exceptions (typer.TyperException), older typers click's.
    except (typer.TyperException, click.ClickException) as e:
        command = e.ctx.command_path if getattr(e, "ctx", None) else "kvexport"
        print(f"kvexport: error: {e.format_message().rstrip('.')}; see `{command} --help`", file=sys.stderr)
        sys.exit(getattr(e, "exit_code", 2))
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # The staged output folder is already removed (see artifact/staging.py).
        where = e.filename or "the output"
        print(f"kvexport: error: {e.strerror} while writing {where}; free some space or choose another -o", file=sys.stderr)
        sys.exit(2)
    finally:  # main() also runs inside other programs (the tests): give their handlers back
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    sys.exit(rc if isinstance(rc, int) else 0)

