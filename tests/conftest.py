"""Fixtures shared by the whole suite. Artifacts are exported once per session and reused."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from kvexport.models.presets import PRESETS, build_preset

# Under pytest-xdist each worker gets its share of the CPUs (make test runs one worker per core):
# torch here, and the runtimes' pools (ONNX Runtime, ExecuTorch, genai) here and in the processes the
# tests start, which inherit the variables. Two workers whose pools each take every core spin against
# each other (docs/development.md#ci).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, (os.cpu_count() or 1) // WORKERS)
torch.set_num_threads(THREADS)
if WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    os.environ.setdefault("KVEXPORT_THREADS", str(THREADS))

PRESET_NAMES = sorted(PRESETS)
# Presets whose ONNX folder onnxruntime-genai cannot run (the states of convolutions, linear
# attention and Mamba-2 are inputs it does not know); tests/runtime/test_genai_program.py proves it.
GENAI_REFUSES = {"tiny-lfm2", "tiny-qwen3.5", "tiny-granite4", "tiny-bamba", "tiny-falcon-h1", "tiny-nemotron-h"}
TEST_CACHE_LEN = 64
# Longer than every preset's window (6), and the generation goes far past it.
PROMPT = "The quick brown fox jumps over the lazy dog"
NEW_TOKENS = 16


@pytest.fixture
def sigint_raises_keyboard_interrupt():
    """A process a non-interactive shell starts in the background ignores SIGINT (and so does the
    test run it starts); give this one Python's own handler for the test, as a kvexport started
    from a terminal has. For the tests that send SIGINT to their own process."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(params=PRESET_NAMES)
def preset(request) -> str:
    return request.param


@pytest.fixture
def tiny(preset):
    """(name, model, tokenizer) for each preset."""
    model, tokenizer = build_preset(preset)
    return preset, model, tokenizer


def shared_dir(tmp_path_factory) -> Path:
    """A folder every pytest-xdist worker of this run sees (the one run's base folder without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


# .ci/run runs the tiny matrix first and keeps its artifacts under this folder: a row that exported a
# preset with the options a test asks for made the same program, so the test reads that artifact
# (its sums verified) instead of exporting it again. Unset (make test alone), every test exports.
MATRIX_ARTIFACTS = os.environ.get("KVEXPORT_TEST_MATRIX_ARTIFACTS")


def matrix_artifact(export_options: dict) -> Path | None:
    """An artifact the matrix kept whose ``export_options`` are exactly these, or None; the form
    ``--sdpa-query auto`` chose on this machine (recorded with them) is what an export here would
    choose too, and so is ``--int8-kv-sdpa auto``'s where it is what ``auto`` chooses here (a row
    may ask for the other kernel)."""
    from kvexport.artifact.manifest import read_manifest
    from kvexport.errors import KvexportError
    from kvexport.exporter.executorch.target import choose_int8_kv_sdpa

    auto_kernel = choose_int8_kv_sdpa("auto", "int8")
    for path in sorted(Path(MATRIX_ARTIFACTS).glob("**/artifact/kvexport.json")) if MATRIX_ARTIFACTS else []:
        kept = json.loads(path.read_text()).get("export_options", {})
        if "sdpa_query" not in export_options:
            kept.pop("sdpa_query", None)
        if "int8_kv_sdpa" not in export_options and kept.get("int8_kv_sdpa") == auto_kernel:
            kept.pop("int8_kv_sdpa")
        if kept == export_options:
            try:
                read_manifest(path.parent)  # verifies every file's sum
            except KvexportError:
                continue
            return path.parent
    return None


def exported_once(tmp_path_factory, name: str, export) -> Path:
    """``export(folder)`` run once per test run for ``name``, whichever worker asks first; the others
    wait for it and share the folder (tests only read artifacts)."""
    from filelock import FileLock

    folder = shared_dir(tmp_path_factory) / "shared-artifacts" / name
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if not (folder / "kvexport.json").is_file():
            export(folder)
    return folder


@pytest.fixture(scope="session")
def artifact(tmp_path_factory):
    """``artifact(name, target, quantize=None, quantize_embedding=None, quantize_lm_head=None,
    dtype="float32", kv_cache="float", max_draft_tokens=0, quantize_grid=None, sdpa_query="auto",
    int8_kv_sdpa="auto", decode_attention="custom-sdpa")`` -> folder,
    exported once per test run."""
    import kvexport
    from kvexport.exporter.pipeline import choose_prefill_chunk

    def get(name: str, target: str = "executorch", quantize: str | None = None, quantize_embedding: str | None = None,
            quantize_lm_head: str | None = None, dtype: str = "float32", kv_cache: str = "float", max_draft_tokens: int = 0,
            quantize_grid: str | None = None, sdpa_query: str = "auto", int8_kv_sdpa: str = "auto",
            decode_attention: str = "custom-sdpa"):
        key = (name, target, quantize, quantize_embedding, quantize_lm_head, dtype, kv_cache, quantize_grid, sdpa_query,
               int8_kv_sdpa, decode_attention)
        suffix = "".join(f"-{q}" for q in key[2:] if q and q not in ("float32", "float", "auto", "custom-sdpa"))
        suffix += f"-draft{max_draft_tokens}" if max_draft_tokens else ""
        options = dict(dtype=dtype, quantize=quantize, quantize_embedding=quantize_embedding, quantize_lm_head=quantize_lm_head,
                       quantize_grid=quantize_grid, kv_cache=kv_cache, sdpa_query=sdpa_query, int8_kv_sdpa=int8_kv_sdpa,
                       max_draft_tokens=max_draft_tokens, decode_attention=decode_attention)
        recorded = {"model": name, "target": target, "dtype": dtype, "max_cache_len": TEST_CACHE_LEN,
                    "prefill_chunk": choose_prefill_chunk(TEST_CACHE_LEN, None),
                    **{option: value for option, value in options.items()
                       if option != "dtype" and value and value not in ("float", "auto", "custom-sdpa")}}
        if (kept := matrix_artifact(recorded)) is not None:
            return kept

        def export(out: Path) -> None:  # the CLI's bytes: in a child process unless this one has kvexport's hash seed
            kvexport.export(name, target, out, max_cache_len=TEST_CACHE_LEN, force=True, quiet=True, **options)

        return exported_once(tmp_path_factory, f"{name}-{target}{suffix}", export)

    return get
