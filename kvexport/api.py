"""kvexport's Python API: what the ``kvexport`` command does, for notebooks, scripts and other tools.

    import kvexport

    artifact = kvexport.export("tiny-llama", "onnx", output="tiny-llama-onnx", max_cache_len=64)
    print(artifact.generate("The quick brown fox", max_new_tokens=8).text)
    assert kvexport.check(artifact.folder).passed

A user error is raised as ``kvexport.KvexportError`` with the CLI's one-line message.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import KvexportError
from .exporter import EXPORT_HASH_SEED

if TYPE_CHECKING:
    from .artifact.manifest import Manifest
    from .checker.check import CheckReport
    from .runtime.chat import Conversation
    from .runtime.generation import Generation


def export(
    model: str,
    target: str = "executorch",
    output: str | Path | None = None,
    *,
    max_cache_len: int | None = None,
    prefill_chunk: int | None = None,
    dtype: str = "float32",
    quantize: str | None = None,
    quantize_embedding: str | None = None,
    quantize_lm_head: str | None = None,
    quantize_grid: str | None = None,
    kv_cache: str = "float",
    sdpa_query: str = "auto",
    int8_kv_sdpa: str = "auto",
    decode_attention: str = "custom-sdpa",
    max_draft_tokens: int = 0,
    force: bool = False,
    quiet: bool = False,
    revision: str | None = None,
    offline: bool = False,
    gguf_file: str | None = None,
) -> Artifact:
    """Export ``model`` (alias, tiny preset, HF folder, ``.gguf`` file or hub id) for ``target``
    (``"executorch"`` or ``"onnx"``) into ``output`` (default ``MODEL-TARGET``); the options are
    ``kvexport export``'s (a hub id is downloaded unless ``offline``). Progress goes to stderr
    unless ``quiet``.

    The bytes are the CLI's: where this process's hash seed is not kvexport's, the export runs in a
    child process that has it."""
    options = {
        "max_cache_len": max_cache_len, "prefill_chunk": prefill_chunk, "dtype": dtype, "quantize": quantize,
        "quantize_embedding": quantize_embedding, "quantize_lm_head": quantize_lm_head, "quantize_grid": quantize_grid,
        "kv_cache": kv_cache, "sdpa_query": sdpa_query, "int8_kv_sdpa": int8_kv_sdpa, "decode_attention": decode_attention,
        "max_draft_tokens": max_draft_tokens, "force": force,
        "quiet": quiet, "revision": revision, "offline": offline, "gguf_file": gguf_file,
    }
    if os.environ.get("PYTHONHASHSEED") == EXPORT_HASH_SEED:
        result = export_in_this_process(model, target, output, **options)
        return Artifact(result.folder, result.manifest)
    return _export_in_child(model, target, output, options)


def load(path: str | Path, device: str = "cpu") -> Artifact:
    """An artifact folder, or an archive from ``kvexport pack`` (unpacked into a temporary folder
    for as long as the returned object lives); every file is verified against ``kvexport.json``."""
    from .artifact.archive import open_artifact

    path = Path(path)
    if path.is_dir():
        with open_artifact(path) as (folder, manifest):
            return Artifact(folder, manifest, device)
    unpacked = Path(tempfile.mkdtemp(prefix="kvexport-"))
    try:
        with open_artifact(path) as (folder, manifest):
            kept = Path(shutil.copytree(folder, unpacked / folder.name))
    except BaseException:
        shutil.rmtree(unpacked, ignore_errors=True)
        raise
    artifact = Artifact(kept, manifest, device)
    weakref.finalize(artifact, shutil.rmtree, unpacked, True)
    return artifact


def check(
    path: str | Path,
    prompts: list[str] | None = None,
    max_new_tokens: int | None = None,
    device: str = "cpu",
    model: str | None = None,
    runner: str = "kvexport",
    baseline: str | Path | None = None,
    draft: str | Path | None = None,
    draft_tokens: int | None = None,
    min_agreement: float | None = None,
) -> CheckReport:
    """``kvexport check``: the artifact against eager transformers (``model``: another reference
    than the one the artifact came from; ``runner="genai"``: run it in onnxruntime-genai;
    ``baseline``: for an int8 KV cache, the same export with a float one, compared too; ``draft``:
    ``"ngram"`` or a drafting artifact's folder, the artifact generating speculatively,
    ``draft_tokens`` at a time; ``min_agreement``: a quantized artifact's bar, default 0.95). ``.passed`` says whether it holds; ``.prompts`` has each prompt's
    comparison."""
    from .artifact.manifest import read_manifest
    from .checker.check import choose_prompts, run_check
    from .runtime.tokenizer import ArtifactTokenizer

    folder = Path(path)
    manifest = read_manifest(folder)
    chosen = choose_prompts(manifest, ArtifactTokenizer(folder), prompts, max_new_tokens)
    return run_check(folder, chosen, device, model, runner=runner, baseline=None if baseline is None else Path(baseline),
                     draft=None if draft is None else str(draft), draft_tokens=draft_tokens, min_agreement=min_agreement)


class Artifact:
    """An exported artifact: its folder, its manifest (``kvexport.json``), and generation with it."""

    def __init__(self, folder: Path, manifest: Manifest, device: str = "cpu"):
        self.folder = Path(folder)
        self.manifest = manifest
        self.device = device
        self._program = None
        self._tokenizer = None

    def __repr__(self) -> str:
        m = self.manifest
        return f"Artifact({str(self.folder)!r}, target={str(m.target)!r}, dtype={str(m.dtype)!r}, max_cache_len={m.max_cache_len})"

    @property
    def target(self) -> str:
        return self.manifest.target

    @property
    def max_cache_len(self) -> int:
        return self.manifest.max_cache_len

    @property
    def tokenizer(self):
        from .runtime.tokenizer import ArtifactTokenizer

        if self._tokenizer is None:
            self._tokenizer = ArtifactTokenizer(self.folder)
        return self._tokenizer

    @property
    def program(self):
        """The loaded program (``forward(tokens, start) -> logits``), loaded on first use."""
        from .runtime.programs import load_program

        if self._program is None:
            self._program = load_program(self.folder, self.manifest, self.device)
        return self._program

    def generate(
        self,
        prompt: str,
        max_new_tokens: int | None = None,
        *,
        chat: bool = False,
        ignore_eos: bool = False,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        on_token: Callable[[int], None] | None = None,
        draft: str | Path | None = None,
        draft_tokens: int | None = None,
    ) -> Generation:
        """``kvexport run``: generate from ``prompt`` (with ``chat``, wrapped in the model's chat
        template) until EOS, ``max_new_tokens`` or a full cache. The result has ``.text``,
        ``.new_ids``, ``.prompt_ids``, ``.stopped_by`` and the prefill and decode speeds. ``draft``
        (``"ngram"`` or a drafting artifact's folder; greedy only): the same tokens, decoded
        speculatively, ``draft_tokens`` at a time, and ``.speculation`` says how many were accepted."""
        import contextlib

        from .errors import InvalidOptionError
        from .runtime.generation import Sampling, check_fits
        from .runtime.run import encode_prompt, generate_text
        from .runtime.speculation import load_drafter

        sampling = Sampling(temperature, top_p, seed)
        if draft is not None and temperature:
            raise InvalidOptionError("draft decodes greedily: leave out temperature")
        prompt_ids = encode_prompt(self.tokenizer, prompt, chat)
        check_fits(len(prompt_ids), max_new_tokens, self.max_cache_len)
        with contextlib.ExitStack() as stack:
            drafter = load_drafter(str(draft), stack, self.device) if draft is not None else None
            return generate_text(self.program, self.tokenizer, prompt_ids, max_new_tokens, ignore_eos, chat, sampling,
                                 on_token=on_token, drafter=drafter, draft_tokens=draft_tokens)

    def chat(self, system: str | None = None, max_new_tokens: int | None = None, *, temperature: float = 0.0,
             top_p: float = 1.0, seed: int | None = None, draft: str | Path | None = None,
             draft_tokens: int | None = None) -> Conversation:
        """A conversation (``kvexport chat``): ``.say(text)`` returns each reply (a ``Turn``: ``.text``,
        ``.reply_ids``, ``.prefilled_tokens``, ...), feeding only the tokens new since the last turn;
        ``.reset()`` starts over. ``draft`` (``"ngram"`` or a drafting artifact's folder; greedy
        only): the same replies, decoded speculatively, and each turn's ``.speculation`` says how."""
        from .runtime.chat import Conversation
        from .runtime.generation import Sampling
        from .runtime.speculation import load_drafter

        stack = contextlib.ExitStack()
        drafter = load_drafter(str(draft), stack, self.device) if draft is not None else None
        conversation = Conversation(self.program, self.tokenizer, self.manifest, system, Sampling(temperature, top_p, seed),
                                    max_new_tokens, drafter, draft_tokens)
        weakref.finalize(conversation, stack.close)  # a drafting archive's folder, unpacked while the conversation lives
        return conversation

    def check(self, prompts: list[str] | None = None, max_new_tokens: int | None = None, device: str = "cpu",
              model: str | None = None) -> CheckReport:
        """``kvexport.check`` of this artifact."""
        return check(self.folder, prompts, max_new_tokens, device, model)


def export_in_this_process(model: str, target: str, output, quiet: bool = False, **options):
    """``export`` without the child process: the artifact's bytes follow this process's hash seed
    (the CLI's is kvexport's). Returns the pipeline's ``ExportResult`` (folder, manifest, step times)."""
    from .exporter.pipeline import ExportOptions, export_model
    from .progress import Progress

    return export_model(ExportOptions(model, target, Path(output) if output else None, **options), Progress(quiet=quiet))


def _export_argv(model: str, target: str, output, options: dict) -> list[str]:
    """``kvexport export``'s arguments; the model name last, after ``--``: any string is a model
    name here, one that looks like an option (``--help``) included."""
    argv = ["export", "--target", target, "--json"]
    if output is not None:
        argv += ["--out", str(output)]
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not None and value is not False:
            argv += [flag, str(value)]
    return [*argv, "--", model]


def _export_in_child(model: str, target: str, output, options: dict) -> Artifact:
    """``kvexport export`` in a child process with kvexport's hash seed; its progress passes
    through to this process's stderr, its one-line error is raised here."""
    env = {**os.environ, "PYTHONHASHSEED": EXPORT_HASH_SEED}
    command = [sys.executable, "-m", "kvexport.cli", *_export_argv(model, target, output, options)]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    said, error = [], None
    try:
        for line in child.stderr:
            if line.startswith("kvexport: error: "):
                error = line.removeprefix("kvexport: error: ").rstrip("\n")
            else:
                said.append(line)
                sys.stderr.write(line)
        out = child.stdout.read()
        code = child.wait()
    except BaseException:  # Ctrl-C here: the child removes its half-built folder on SIGTERM
        child.terminate()
        child.wait()
        raise
    if code != 0:
        if error is not None:
            failure = KvexportError(error)
            failure.exit_code = code
            raise failure
        raise RuntimeError(f"kvexport export failed (exit code {code}):\n{''.join(said[-40:])}")
    folder = Path(json.loads(out.strip().splitlines()[-1])["folder"])
    return load(folder)

