"""Runs ``model.pte`` with ExecuTorch's Python runtime (``executorch.runtime``)."""

from __future__ import annotations

import contextlib
import sys
import types
from pathlib import Path

import numpy as np

from ..artifact.manifest import Manifest, program_mismatch
from ..errors import ArtifactError, InvalidOptionError, first_line
from ..logs import native_stderr_quiet
from .blas_threads import one_blas_thread
from .cpu import runtime_threads
from .generation import check_call, check_rows_by_position, check_verification
from .xnnpack_options import WEIGHT_CACHE, set_bool


class ExecuTorchProgram:
    def __init__(self, path: Path, manifest: Manifest, weights: Path | None = None, trace_events: bool = False):
        import torch

        register_kernels(manifest)
        threads_as_asked()
        # forward and verify pack each weight once (xnnpack_options); a bfloat16 program's delegates
        # crash ExecuTorch 1.5.1's runtime as they load with the cache on, and pack their own.
        set_bool(WEIGHT_CACHE, manifest.dtype != "bfloat16")
        from executorch.runtime import Runtime

        self.manifest = manifest
        self._chunk = manifest.max_tokens_per_call
        self._next_start = 0
        # Speculative decoding: a verification takes this many drafted tokens at most, and a call may
        # start up to ``_rewind`` positions before the sequence's end.
        self.max_draft_tokens = manifest.max_draft_tokens
        self._rewind = manifest.rewind
        self._torch = torch
        self._path = path
        check_program_file(path, manifest)  # before forward loads: its memory is planned for the program
        try:
            # trace_events: ExecuTorch's ETDump tracer times every kernel and delegate call
            # (scripts/profile_pte.py); off, the runtime records nothing.
            with native_stderr_quiet():
                self._program = Runtime.get().load_program(path, data_path=weights, enable_etdump=trace_events)
                self._method = self._program.load_method("forward")
        except Exception as e:  # the runtime raises a bare RuntimeError for any unreadable program
            raise ArtifactError(f"ExecuTorch cannot load {path}: {first_line(e)}")
        # --max-draft-tokens: `verify` returns every position's logits, over forward's cache buffers.
        # Loaded on first use: its delegates pack the weights again (memory for a second copy).
        self._verify = None

    def _verify_method(self):
        if self._verify is None:
            try:
                with native_stderr_quiet():
                    self._verify = self._program.load_method("verify")
            except Exception as e:  # as for forward
                raise ArtifactError(f"ExecuTorch cannot load the verify method of {self._path}: {first_line(e)}")
        return self._verify

    def forward(self, tokens: list[int], start: int) -> np.ndarray:
        torch = self._torch
        # A ring's slots are a function of the start: a call elsewhere than where the sequence is would
        # read the wrong rows (up to max_draft_tokens back: a ring's spare slots hold what it needs;
        # full layers only: anywhere back, the call writing its rows again).
        check_call(tokens, start, self._next_start, self.manifest.max_cache_len, self._rewind)
        # Activation memory is planned for calls of at most `_chunk` tokens: a longer prompt takes several.
        for first in range(0, len(tokens), self._chunk):
            chunk = tokens[first : first + self._chunk]
            inputs = [torch.tensor([chunk], dtype=torch.long), torch.tensor([start + first], dtype=torch.long)]
            with one_blas_thread() if len(chunk) > 1 else contextlib.nullcontext():
                logits = self._method.execute(inputs)[0]
        self._next_start = start + len(tokens)
        # Copy: the runtime may reuse the output memory on the next call.
        return logits[0].to(torch.float32, copy=True).numpy()

    def verify(self, tokens: list[int], start: int) -> np.ndarray:
        """One call of ``tokens`` from ``start`` (the last chosen token, then drafted ones): the logits
        ``[T, vocab]`` of each of its positions. A ``.pte`` exported before ``verify`` took calls of
        any length (no ``verify_tokens`` in its manifest) takes exactly ``max_draft_tokens + 1``:
        fewer are padded there (the padding's rows are written and dropped, as rejected drafts' are),
        and near the cache's end, where the padding would not fit, the positions are one-token calls."""
        torch = self._torch
        check_verification(tokens, self.max_draft_tokens)
        verify = self._verify_method()
        check_call(tokens, start, self._next_start, self.manifest.max_cache_len, self._rewind)
        call = tokens
        if "verify_tokens" not in self.manifest.facts:
            most = self.max_draft_tokens + 1
            if start + most > self.manifest.max_cache_len:
                return np.stack([self.forward([token], start + i) for i, token in enumerate(tokens)])
            call = tokens + tokens[-1:] * (most - len(tokens))
        with one_blas_thread():
            logits = verify.execute([torch.tensor([call], dtype=torch.long), torch.tensor([start], dtype=torch.long)])[0]
        self._next_start = start + len(tokens)
        return logits[0, : len(tokens)].to(torch.float32, copy=True).numpy()

    def draft_rewind(self, positions: int) -> bool:
        """As a drafter: let a call start up to ``positions`` before the sequence's end. True where
        its cache then holds what such a call reads (``Manifest.rewind``); False where a ring has
        fewer spare slots: past its window, the rows the rejected drafts wrote stand in for the
        oldest of the window for a while (the drafts may differ from exact ones; what a verification
        keeps never does)."""
        if positions <= self._rewind:
            return True
        check_rows_by_position(self.manifest)
        self._rewind = positions
        return False

    def write_event_trace(self, path: Path) -> None:
        """Write the ETDump of every call so far (needs ``trace_events=True``)."""
        self._program.write_etdump_result_to_file(str(path), str(Path(path).with_suffix(".debug")))

    def reset(self) -> None:
        # Nothing to clear: a call at position 0 starts a new sequence (the masks ignore older state).
        self._next_start = 0


def set_executorch_threads(threads: int) -> None:
    """Size the threadpool of ExecuTorch's Python runtime (XNNPACK's kernels, TextLLMRunner), one per
    process."""
    import_runtime()
    from executorch.extension.pybindings.portable_lib import _threadpool_get_thread_count, _unsafe_reset_threadpool

    with native_stderr_quiet():  # the pool probes the CPU when it starts, and logs a reset
        if _threadpool_get_thread_count() != threads:
            _unsafe_reset_threadpool(threads)
    if _threadpool_get_thread_count() != threads:
        raise RuntimeError(f"ExecuTorch's threadpool has {_threadpool_get_thread_count()} threads, not {threads}")


def threads_as_asked() -> None:
    """ExecuTorch's threadpool sized by ``KVEXPORT_THREADS`` where it is set."""
    if (threads := runtime_threads()) is not None:
        set_executorch_threads(threads)


# ExecuTorch's ScalarType codes of the manifest's dtypes.
_SCALAR_TYPES = {6: "float32", 5: "float16", 15: "bfloat16"}


def _program_facts(program) -> dict:
    """What the ``.pte`` says of itself: its metadata methods (``get_max_context_len``, ...; see the
    exporter's ``_constant_methods``), and its logits' shape and dtype. Read from a program object of
    their own: the Python runtime shares one memory arena among a program's methods, so running a
    metadata method there could overwrite the forward method's."""
    facts = {}
    for name in ("get_max_context_len", "get_max_seq_len", "get_vocab_size", "get_n_layers", "get_eos_ids", "get_bos_id"):
        if name in program.method_names:
            facts[name] = [int(v) for v in program.load_method(name).execute([])]
    logits = program.metadata("forward").output_tensor_meta(0)
    facts["logits_shape"], facts["logits_dtype"] = list(logits.sizes()), _SCALAR_TYPES.get(logits.dtype(), logits.dtype())
    return facts


def check_program_file(path: Path, manifest: Manifest) -> None:
    """Refuse a ``.pte`` that the manifest does not describe (``check_against_program``), or that
    ExecuTorch cannot read. Call ``register_kernels`` first."""
    from executorch.runtime import Runtime

    try:
        with native_stderr_quiet():
            facts = _program_facts(Runtime.get().load_program(path))
    except Exception as e:  # the runtime raises a bare RuntimeError for any unreadable program
        raise ArtifactError(f"ExecuTorch cannot load {path}: {first_line(e)}")
    check_against_program(manifest, facts)


def check_against_program(manifest: Manifest, facts: dict) -> None:
    """Refuse a manifest that does not describe the program (``_program_facts``): a wrong cache length,
    call length, vocabulary or layer count ends in a runtime failure mid-generation, or in a silently
    wrong generation."""
    said = {
        "get_max_context_len": ("max_cache_len", [manifest.max_cache_len]),
        "get_vocab_size": ("vocab_size", [manifest.vocab_size]),
        "get_n_layers": ("the number of layers is", [len(manifest.layers)]),
        "get_eos_ids": ("eos_token_ids", sorted(manifest.eos_token_ids)),
    }
    if manifest.format_version >= 4:  # before, a .pte took calls as long as the cache, whatever it said
        said["get_max_seq_len"] = ("interface.max_tokens_per_call", [manifest.max_tokens_per_call])
    if manifest.bos_token_id is not None:
        said["get_bos_id"] = ("bos_token_id", [manifest.bos_token_id])
    for method, (field, value) in said.items():
        has = facts.get(method)
        if has is not None and (sorted(has) if method == "get_eos_ids" else has) != value:
            raise program_mismatch(field, _one(value), f"{_one(has)} ({method})")
    if facts["logits_shape"][-1:] != [manifest.vocab_size]:
        raise program_mismatch("vocab_size", manifest.vocab_size, f"logits of shape {facts['logits_shape']}")
    if facts["logits_dtype"] != manifest.dtype:
        raise program_mismatch("dtype", manifest.dtype, f"{facts['logits_dtype']} logits")


def _one(values: list):
    return values[0] if len(values) == 1 else values


def register_kernels(manifest: Manifest | None = None) -> None:
    """Register the kernels of ExecuTorch's LLM custom ops (``llama::custom_sdpa``, ``llama::update_cache``)
    and of its quantized ops (``quantized_decomposed::embedding_byte`` / ``embedding_4bit``, a quantized
    embedding) with the runtime, and kvexport's own where ``manifest``'s program calls one (its
    ``custom_ops``: ``--decode-attention kvexport``); a ``.pte`` that uses them cannot load otherwise."""
    import_runtime()
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401
    import executorch.kernels.quantized  # noqa: F401

    if manifest is not None and any(op.startswith("kvexport::") for op in manifest.facts.get("custom_ops", ())):
        from ..kernels import load_kernels

        load_kernels()


_PORTABLE_LIB = "executorch.extension.pybindings.portable_lib"


def import_runtime() -> None:
    """Import ExecuTorch's Python runtime (``portable_lib``) without its exporter. ``portable_lib``
    imports ``executorch.exir._warnings`` for one warning class, and that import runs the
    ``executorch.exir`` package's ``__init__``, which imports the whole export stack: most of a
    ``kvexport run`` of a ``.pte`` before its first token. While the runtime imports, a bare stand-in
    holds the package's place, so that the one file loads alone; the stand-in and that file are dropped
    after, and a later ``import executorch.exir`` (an export in the same process) imports the real
    package. Where the exporter is already loaded, or anything else goes wrong, the plain import."""
    if _PORTABLE_LIB in sys.modules or "executorch.exir" in sys.modules:
        return
    import executorch

    stand_in = types.ModuleType("executorch.exir")
    stand_in.__path__ = [str(Path(folder) / "exir") for folder in executorch.__path__]
    before = set(sys.modules)
    sys.modules["executorch.exir"] = stand_in
    try:
        __import__(_PORTABLE_LIB)
    except Exception:
        sys.modules.pop(_PORTABLE_LIB, None)
    finally:  # nothing of the exporter's package stays imported under the stand-in
        for name in set(sys.modules) - before:
            if name == "executorch.exir" or name.startswith("executorch.exir."):
                del sys.modules[name]
    __import__(_PORTABLE_LIB)  # imported above, or the plain way


def load(folder: Path, manifest: Manifest, device: str, trace_events: bool = False) -> ExecuTorchProgram:
    if device != "cpu":
        raise InvalidOptionError("ExecuTorch artifacts run on the CPU (XNNPACK); use --device cpu")
    weights = folder / manifest.weights if manifest.weights else None
    return ExecuTorchProgram(folder / manifest.program, manifest, weights, trace_events)
