"""Fixtures shared by the whole suite. Artifacts are exported once per session and reused."""

from __future__ import annotations

import os

import pytest
import torch

from kvexport.models.presets import PRESETS, build_preset

torch.set_num_threads(max(1, os.cpu_count() or 1))

PRESET_NAMES = sorted(PRESETS)
TEST_CACHE_LEN = 64
# Longer than every preset's window (6), and the generation goes far past it.
PROMPT = "The quick brown fox jumps over the lazy dog"
NEW_TOKENS = 16


@pytest.fixture(params=PRESET_NAMES)
def preset(request) -> str:
    return request.param


@pytest.fixture
def tiny(preset):
    """(name, model, tokenizer) for each preset."""
    model, tokenizer = build_preset(preset)
    return preset, model, tokenizer


@pytest.fixture(scope="session")
def artifact(tmp_path_factory):
    """``artifact(name, target, quantize=None, quantize_embedding=None, quantize_lm_head=None,
    dtype="float32")`` -> folder, exported once per session."""
    from kvexport.exporter.pipeline import ExportOptions, export_model
    from kvexport.progress import Progress

    cache: dict[tuple, object] = {}

    def get(name: str, target: str = "executorch", quantize: str | None = None, quantize_embedding: str | None = None,
            quantize_lm_head: str | None = None, dtype: str = "float32"):
        key = (name, target, quantize, quantize_embedding, quantize_lm_head, dtype)
        if key not in cache:
            suffix = "".join(f"-{q}" for q in key[2:] if q and q != "float32")
            out = tmp_path_factory.mktemp("artifacts") / f"{name}-{target}{suffix}"
            options = ExportOptions(
                name, target, out, TEST_CACHE_LEN, dtype=dtype, quantize=quantize,
                quantize_embedding=quantize_embedding, quantize_lm_head=quantize_lm_head,
            )
            export_model(options, Progress(quiet=True))
            cache[key] = out
        return cache[key]

    return get
