"""Sizes at their edges (a cache of one position, a call of one token, a cache shorter than a
window): each exports exactly or is refused before the weights load, and export, check's default
prompts and run agree on what fits."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvexport.artifact.manifest import Manifest, read_manifest
from kvexport.checker.check import default_prompts
from kvexport.errors import InvalidOptionError, PromptTooLongError
from kvexport.exporter.pipeline import ExportOptions, export_model, plan_export
from kvexport.models.presets import build_preset
from kvexport.progress import Progress
from kvexport.runtime.generation import check_fits
from kvexport.runtime.programs import load_program
from kvexport.runtime.tokenizer import ArtifactTokenizer

from tests.conftest import PROMPT
from tests.helpers import FP32_LOGIT_ATOL, assert_generation_matches, eager_reference, fake_manifest, greedy_with

ONNX_SHORTEST = 3  # the ONNX graph's sizes are traced from a call of 2 tokens after a cached one


def expected_chunk(target: str, max_cache_len: int, prefill_chunk: int | None) -> int:
    """Calls of up to 2 tokens are no one ExecuTorch program (torch.export's dynamic sizes start at
    2): a cache of 2 positions gets calls of 1 token by default."""
    if prefill_chunk is not None:
        return prefill_chunk
    return 1 if (target, max_cache_len) == ("executorch", 2) else max_cache_len


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    """The presets' tokenizer (one for all), as an artifact holds it."""
    folder = tmp_path_factory.mktemp("tokenizer")
    build_preset("tiny-llama")[1].save_pretrained(folder)
    return folder


def assert_check_prompts_fit(manifest: Manifest, tokenizer: ArtifactTokenizer) -> None:
    """check's default prompts are ones run takes: each fits the cache, or, where no prompt can
    (a cache of fewer positions than a one-letter prompt's tokens), check says so in one line."""
    try:
        prompts = default_prompts(manifest, tokenizer)
    except PromptTooLongError as e:
        assert len(tokenizer.encode("T")) > manifest.max_cache_len, e
        return
    for text, n in prompts:
        check_fits(len(tokenizer.encode(text)), n, manifest.max_cache_len)


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(["tiny-llama", "tiny-mistral", "tiny-gemma3"]),  # no window, one of 6 tokens, rings and full layers
    target=st.sampled_from(["executorch", "onnx"]),
    max_cache_len=st.integers(1, 40),
    prefill_chunk=st.one_of(st.none(), st.integers(1, 40)),
)
def test_every_size_is_planned_or_refused_and_check_s_prompts_fit_it(tmp_path_factory, tokenizer_folder, name, target,
                                                                      max_cache_len, prefill_chunk):
    out = tmp_path_factory.mktemp("plan") / "out"
    options = ExportOptions(name, target, out, max_cache_len, prefill_chunk=prefill_chunk)
    refused = (
        (target == "onnx" and max_cache_len < ONNX_SHORTEST)
        or (prefill_chunk or 0) > max_cache_len
        or (target == "executorch" and prefill_chunk == 2)
    )
    if refused:
        with pytest.raises(InvalidOptionError, match="--max-cache-len|--prefill-chunk"):
            plan_export(options)
        return
    plan = plan_export(options)
    assert (plan.max_cache_len, plan.prefill_chunk) == (max_cache_len, expected_chunk(target, max_cache_len, prefill_chunk))
    assert not out.exists()
    assert_check_prompts_fit(fake_manifest(max_cache_len=max_cache_len, layers=tuple(plan.layers())), ArtifactTokenizer(tokenizer_folder))


@pytest.mark.parametrize(
    "name, target, max_cache_len, prefill_chunk",
    [
        ("tiny-llama", "executorch", 1, None),  # one position: a decode-only program
        ("tiny-llama", "executorch", 2, None),  # calls of 1 token (see expected_chunk)
        ("tiny-llama", "executorch", 16, 1),  # --prefill-chunk 1: T static at 1
        ("tiny-llama", "onnx", ONNX_SHORTEST, None),
        ("tiny-llama", "onnx", 16, 1),
        ("tiny-mistral", "executorch", 4, None),  # a cache shorter than the window (6)
        ("tiny-mistral", "onnx", 4, None),
    ],
    ids=["et-cache-1", "et-cache-2", "et-chunk-1", "onnx-cache-3", "onnx-chunk-1", "et-below-window", "onnx-below-window"],
)
def test_a_size_at_its_edge_exports_exactly(tmp_path, name, target, max_cache_len, prefill_chunk):
    """The artifact fills its cache with eager's tokens and logits, and check's prompts fit it."""
    folder = tmp_path / "out"
    export_model(ExportOptions(name, target, folder, max_cache_len, prefill_chunk=prefill_chunk), Progress(quiet=True))
    manifest = read_manifest(folder)
    chunk = expected_chunk(target, max_cache_len, prefill_chunk)
    assert (manifest.max_cache_len, manifest.max_tokens_per_call) == (max_cache_len, chunk)
    model, tokenizer = build_preset(name)
    prompt = tokenizer(PROMPT).input_ids[: max(1, max_cache_len // 2)]
    n = max_cache_len - len(prompt) + 1  # the last new token is not fed back: the cache is full
    got = greedy_with(load_program(folder).forward, prompt, n)
    assert_generation_matches(got, eager_reference(model, prompt, n), FP32_LOGIT_ATOL, f"{name} {target} {max_cache_len}")
    assert_check_prompts_fit(manifest, ArtifactTokenizer(folder))
