"""``kvexport chat``: one user turn per line of stdin, each reply streamed to stdout; Ctrl-C stops a
reply, not the conversation. The conversation itself (what each turn feeds the cache) is
``kvexport.runtime.chat.Conversation``'s."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import InvalidOptionError, KvexportError
from .options import GENAI_RUNNER_HELP, DraftTokens, check_runner


def chat_command(
    artifact: Annotated[Path, typer.Argument(metavar="DIR|ARCHIVE", help="artifact folder, or archive from kvexport pack")],
    system: Annotated[Optional[str], typer.Option("--system", metavar="TEXT", help="system prompt")] = None,
    max_new_tokens: Annotated[
        Optional[int],
        typer.Option(metavar="N", help="most new tokens per reply [default: until the end of the turn or the cache is full]"),
    ] = None,
    temperature: Annotated[float, typer.Option(metavar="T", help="0 is greedy")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", metavar="P", help="nucleus sampling threshold")] = 1.0,
    seed: Annotated[Optional[int], typer.Option(metavar="S", help="sampling seed")] = None,
    device: Annotated[str, typer.Option(metavar="cpu|cuda", help="cpu or cuda (float16 ONNX artifacts)")] = "cpu",
    runner: Annotated[str, typer.Option(metavar="kvexport|genai", help=GENAI_RUNNER_HELP)] = "kvexport",
    draft: Annotated[
        Optional[str], typer.Option(metavar="ngram|ARTIFACT", help="speculative decoding (greedy, the same replies): draft with prompt lookup (ngram) or another artifact of the same tokenizer; the artifact must be exported with --max-draft-tokens")
    ] = None,
    draft_tokens: DraftTokens = None,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object per reply on stdout, no streamed text")] = False,
):
    """Chat with the artifact in its chat template, one user turn per line (/reset starts over, /exit ends);
    the cache is kept across turns, so each turn feeds only its new tokens."""
    check_runner(runner)
    ok = chat_loop(artifact, system, max_new_tokens, temperature, top_p, seed, device, as_json, runner, draft, draft_tokens)
    raise typer.Exit(0 if ok else 2)


class StopOnCtrlC:
    """While a reply runs, Ctrl-C (SIGINT) asks it to stop instead of ending the program. A flag
    checked between tokens, not an exception: a program call is never cut in the middle."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __call__(self) -> bool:
        return self.requested

    def _handle(self, signum, frame):
        self.requested = True

    def __enter__(self):
        try:
            previous = signal.getsignal(signal.SIGINT)
            if previous is not signal.SIG_IGN:  # not where a shell set it to be ignored
                signal.signal(signal.SIGINT, self._handle)
                self._previous = previous
        except ValueError:  # not the main thread: signals stay as they are
            pass
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return False


def read_line(stdin, interactive: bool) -> str | None:
    """The next user line; None at the end (Ctrl-D, or the end of the piped input)."""
    if not interactive:
        line = stdin.readline()
        return None if line == "" else line.rstrip("\r\n")
    previous = signal.getsignal(signal.SIGINT)
    while True:
        try:
            if previous is not signal.SIG_IGN:
                signal.signal(signal.SIGINT, signal.default_int_handler)
            return input("> ")
        except EOFError:
            print(file=sys.stderr)
            return None
        except KeyboardInterrupt:  # Ctrl-C at the prompt drops the line, as a shell does
            print(file=sys.stderr)
        finally:
            signal.signal(signal.SIGINT, previous)


def chat_loop(artifact: Path, system: str | None, max_new_tokens: int | None, temperature: float, top_p: float,
              seed: int | None, device: str, as_json: bool, runner: str = "kvexport", draft: str | None = None,
              draft_tokens: int | None = None) -> bool:
    """One user turn per line of stdin. True if every turn got its reply."""
    from ..artifact.archive import open_artifact
    from ..runtime.chat import Conversation, require_chat_template
    from ..runtime.generation import Sampling
    from ..runtime.programs import load_program
    from ..runtime.speculation import load_drafter
    from ..runtime.tokenizer import ArtifactTokenizer

    sampling = Sampling(temperature, top_p, seed)
    if max_new_tokens is not None and max_new_tokens < 1:
        raise InvalidOptionError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if draft is not None and (temperature or runner != "kvexport"):
        raise InvalidOptionError("--draft decodes greedily with kvexport's runner: leave out --temperature and --runner")
    stdin = sys.stdin
    if hasattr(stdin, "reconfigure"):  # bytes that are not UTF-8 reach the turn, which refuses it in one line
        stdin.reconfigure(errors="surrogateescape")
    interactive = stdin.isatty()
    with contextlib.ExitStack() as stack:
        folder, manifest = stack.enter_context(open_artifact(artifact))
        tokenizer = ArtifactTokenizer(folder)
        require_chat_template(tokenizer)  # before the program loads
        drafter = load_drafter(draft, stack, device) if draft is not None else None
        conversation = Conversation(load_program(folder, manifest, device, runner), tokenizer, manifest, system, sampling,
                                    max_new_tokens, drafter, draft_tokens)
        if interactive:
            import readline  # noqa: F401  line editing and history for input()

            print(f"[chatting with {artifact} ({manifest.max_cache_len} positions): /reset starts over, "
                  "/exit or Ctrl-D ends, Ctrl-C stops a reply]", file=sys.stderr)
        ok = True
        while (line := read_line(stdin, interactive)) is not None:
            text = line.strip()
            if not text:
                continue
            if text == "/exit":
                break
            if text == "/reset":
                conversation.reset()
                if interactive:
                    print("[a new conversation]", file=sys.stderr)
                continue
            out, told = sys.stdout, []

            def notify(notice: str) -> None:
                told.append(notice)
                print(f"kvexport: {notice}", file=sys.stderr, flush=True)

            def write(piece: str) -> None:
                out.write(piece)
                out.flush()

            try:
                with StopOnCtrlC() as stop:
                    turn = conversation.say(text, on_text=None if as_json else write, stop=stop, on_notice=notify)
            except KvexportError as e:  # this turn only: the conversation goes on
                print(f"kvexport: error: {e}", file=sys.stderr, flush=True)
                ok = False
                continue
            if as_json:
                print(json.dumps(turn.summary()), flush=True)
            else:
                print(flush=True)
                if turn.stopped_by == "caller":
                    print("[stopped]", file=sys.stderr, flush=True)
            for notice in turn.notices:
                if notice not in told:
                    notify(notice)
    return ok
