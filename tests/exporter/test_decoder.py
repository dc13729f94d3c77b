"""The wrapper in eager PyTorch against transformers' own generate, for every preset."""

from __future__ import annotations

import pytest
import torch

from kvexport.errors import UnsupportedModelError
from kvexport.exporter.decoder import ExportableDecoder
from kvexport.exporter.onnx.decoder import ExternalCacheDecoder
from kvexport.models import architecture
from kvexport.models.presets import build_tiny, tiny_config

from tests.conftest import NEW_TOKENS, PROMPT, TEST_CACHE_LEN
from tests.helpers import FP32_LOGIT_ATOL, assert_generation_matches, eager_reference, greedy_with, torch_forward


def test_wrapper_matches_eager_past_the_window(tiny):
    name, model, tokenizer = tiny
    ids = tokenizer(PROMPT).input_ids
    expected = eager_reference(model, ids, NEW_TOKENS)
    decoder = ExportableDecoder(model, TEST_CACHE_LEN)
    got = greedy_with(torch_forward(decoder), ids, NEW_TOKENS)
    assert_generation_matches(got, expected, FP32_LOGIT_ATOL, name)


@pytest.mark.parametrize("chunks", [[1] * 44, [5, 13, 26], [40, 4]])
def test_chunked_prefill_matches_one_call(chunks):
    # A hybrid (ring + static) preset, prompt fed in calls shorter and longer than the window (6).
    from kvexport.models.presets import build_preset

    model, tokenizer = build_preset("tiny-gemma3")
    ids = tokenizer(PROMPT).input_ids
    assert len(ids) == sum(chunks)
    expected = eager_reference(model, ids, NEW_TOKENS)
    decoder = ExportableDecoder(model, TEST_CACHE_LEN)
    got = greedy_with(torch_forward(decoder), ids, NEW_TOKENS, chunks=chunks)
    assert_generation_matches(got, expected, FP32_LOGIT_ATOL, f"chunks {chunks}")


def test_a_new_sequence_at_position_zero_ignores_the_previous_one():
    from kvexport.models.presets import build_preset

    model, tokenizer = build_preset("tiny-mistral")
    decoder = ExportableDecoder(model, TEST_CACHE_LEN)
    forward = torch_forward(decoder)
    greedy_with(forward, tokenizer("something else entirely, and long").input_ids, 10)
    ids = tokenizer(PROMPT).input_ids
    assert_generation_matches(greedy_with(forward, ids, NEW_TOKENS), eager_reference(model, ids, NEW_TOKENS), FP32_LOGIT_ATOL, "reuse")


def external_cache_forward(decoder: ExternalCacheDecoder, window_rows: int | None = None):
    """``forward(tokens, start)`` over the external-cache wrapper, driven as kvexport.json's
    ``interface`` says (the ONNX runners', without ONNX): an attention mask of ones as wide as the
    positions so far, a full layer's buffer of max_cache_len rows, a sliding layer's of its window
    (or ``window_rows``, as onnxruntime-genai's slack gives), present copied back into past; the
    states of layers that do not attend, zeros at first, each present the next call's past."""
    buffers = []
    for layer, spec in decoder.buffer_layers:
        rows = (window_rows or layer.window) if layer.window else decoder.max_cache_len
        buffers.append([torch.zeros(1, spec.kv_heads, rows, spec.head_dim) for _ in range(2)])
    states = [torch.zeros(shape, dtype=dtype) for layer in decoder.state_layers for shape, dtype in layer.shapes]

    def forward(tokens, start):
        past = [b for kv in buffers for b in kv]
        mask = torch.ones(1, start + len(tokens), dtype=torch.long)
        with torch.no_grad():
            logits, *present = decoder(torch.tensor([tokens]), mask, *past, *states)
        for buffer, written in zip(past, present):  # present is the buffer with the call written
            buffer.copy_(written)
        states[:] = present[len(past):]
        assert logits.shape == (1, 1, decoder.model.config.vocab_size)
        return logits[0, 0].numpy()

    return forward


def test_external_cache_wrapper_matches_eager(tiny):
    # Every family through the kernel's semantics: Gemma 2's soft-capping, gpt-oss's sinks included.
    name, model, tokenizer = tiny
    ids = tokenizer(PROMPT).input_ids
    forward = external_cache_forward(ExternalCacheDecoder(model, TEST_CACHE_LEN))
    got = greedy_with(forward, ids, NEW_TOKENS, chunks=[5, 13, 26])
    assert_generation_matches(got, eager_reference(model, ids, NEW_TOKENS), FP32_LOGIT_ATOL, name)


@pytest.mark.parametrize("chunks", [None, [40, 4], [1] * 44])
@pytest.mark.parametrize("window_rows", [None, 9])
def test_external_cache_wrapper_takes_any_call_and_any_window_rows(chunks, window_rows):
    # Calls longer than the window (6) and one token at a time; buffers of the window or more.
    from kvexport.models.presets import build_preset

    model, tokenizer = build_preset("tiny-gemma3")
    ids = tokenizer(PROMPT).input_ids
    expected = eager_reference(model, ids, NEW_TOKENS)
    forward = external_cache_forward(ExternalCacheDecoder(model, TEST_CACHE_LEN), window_rows)
    got = greedy_with(forward, ids, NEW_TOKENS, chunks=chunks)
    assert_generation_matches(got, expected, FP32_LOGIT_ATOL, f"chunks {chunks}, rows {window_rows}")


@pytest.mark.parametrize("rms_norm", [False, True])
@pytest.mark.parametrize("chunks", [[1] * 44, [5, 13, 26]])
def test_falcon_h1_layers_match_eager_in_any_calls_on_both_wrappers(rms_norm, chunks):
    """Falcon-H1's layers (attention and a Mamba-2 mixer side by side: a KV cache and a state each),
    prompts fed one token at a time and in calls shorter and longer than the mixer's chunk (16), on
    the in-program cache and the external one; its mixer's output gated alone (the preset) or through
    its gated norm (``mamba_rms_norm``), the two ways transformers computes it."""
    from kvexport.models.presets import PRESETS, build_tiny, tiny_config

    model_type, overrides = PRESETS["tiny-falcon-h1"]
    model, tokenizer = build_tiny(tiny_config(model_type, {**overrides, "mamba_rms_norm": rms_norm}))
    ids = tokenizer(PROMPT).input_ids
    expected = eager_reference(model, ids, NEW_TOKENS)
    for forward in (torch_forward(ExportableDecoder(model, TEST_CACHE_LEN)),
                    external_cache_forward(ExternalCacheDecoder(model, TEST_CACHE_LEN))):  # fmt: skip
        got = greedy_with(forward, ids, NEW_TOKENS, chunks=chunks)
        assert_generation_matches(got, expected, FP32_LOGIT_ATOL, f"chunks {chunks}, mamba_rms_norm {rms_norm}")


@pytest.mark.parametrize("chunks", [[1] * 44, [5, 13, 26], [40, 4]])
def test_layers_sharing_a_ring_from_every_token_match_eager_in_any_calls(chunks):
    """Gemma 3n's sharing layers attend from every token of a call to what the ring's own layer
    attended to (the ring before the call's write, then the call's keys), on both wrappers; the
    ONNX one's window in plain ops, over buffers of the window's rows or more."""
    from kvexport.models.presets import build_preset

    model, tokenizer = build_preset("tiny-gemma3n")
    ids = tokenizer(PROMPT).input_ids
    expected = eager_reference(model, ids, NEW_TOKENS)
    got = greedy_with(torch_forward(ExportableDecoder(model, TEST_CACHE_LEN)), ids, NEW_TOKENS, chunks=chunks)
    assert_generation_matches(got, expected, FP32_LOGIT_ATOL, f"chunks {chunks}")
    decoder = ExternalCacheDecoder(model, TEST_CACHE_LEN)
    assert [layer.in_plain_ops for layer, _ in decoder.buffer_layers] == [True, False]
    for window_rows in (None, 9):
        got = greedy_with(external_cache_forward(decoder, window_rows), ids, NEW_TOKENS, chunks=chunks)
        assert_generation_matches(got, expected, FP32_LOGIT_ATOL, f"chunks {chunks}, rows {window_rows}")


def test_activation_sparsity_cuts_the_gate_where_transformers_does():
    """Gemma 3n's Gaussian top-k with its normal quantile computed once (neither target has erfinv)
    keeps exactly the activations transformers' own computation keeps, in both dtypes."""
    from kvexport.models.adapters import prepare_for_export
    from kvexport.models.presets import build_preset

    for dtype in (torch.float32, torch.float16):
        model, _ = build_preset("tiny-gemma3n", dtype)
        mlp = model.model.layers[0].mlp
        assert mlp.activation_sparsity > 0
        x = (torch.randn(1, 5, mlp.intermediate_size, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
        expected = mlp._gaussian_topk(x)
        prepare_for_export(model)
        assert "kvexport_normal_quantile" in dict(mlp.named_buffers())
        torch.testing.assert_close(mlp._gaussian_topk(x), expected, atol=0, rtol=0)


@pytest.mark.parametrize("chunks", [[12, 1, 1, 1], [12, 1, 6, 1, 1], [1, 1, 4]])
def test_nemotron_h_steps_as_transformers_does_call_by_call(chunks):
    """Nemotron-H's mixers clamp the step to time_step_min in transformers' chunked scan (the first
    call, whatever its length, and any longer call after it) and not in its 1-token update: the
    wrapper, one program for every call, against transformers' model fed the same calls with its own
    cache, where some steps are below the minimum (so either choice, made wrongly, shows)."""
    from transformers import DynamicCache

    from kvexport.models.presets import build_preset

    model, tokenizer = build_preset("tiny-nemotron-h")
    ids = tokenizer(PROMPT).input_ids[: sum(chunks)]
    mixer = model.model.layers[0].mixer
    with torch.no_grad():
        projected = mixer.in_proj(model.model.layers[0].norm(model.model.embeddings(torch.tensor([ids]))))
        steps = torch.nn.functional.softplus(projected[..., -mixer.num_heads :] + mixer.dt_bias)
    assert (steps < mixer.time_step_limit[0]).any() and (steps > mixer.time_step_limit[0]).any()
    forward = torch_forward(ExportableDecoder(model, TEST_CACHE_LEN))
    cache, start = DynamicCache(config=model.config), 0
    for size in chunks:
        with torch.no_grad():
            expected = model(torch.tensor([ids[start : start + size]]), past_key_values=cache, use_cache=True).logits[0, -1]
        got = torch.as_tensor(forward(ids[start : start + size], start))
        torch.testing.assert_close(got, expected, atol=FP32_LOGIT_ATOL, rtol=0, msg=f"call at {start} of {size} tokens")
        start += size


@pytest.mark.parametrize("model_type", ["gpt2", "gpt_neox", "opt", "gpt_bigcode", "nemotron"])
def test_families_whose_attention_is_laid_out_their_own_way_match_eager(model_type):
    """Multi-head attention that names no KV heads (GPT-2, GPT-NeoX, OPT), one KV head from
    ``multi_query`` (GPT-BigCode): the cache is sized as their attention computes. Decoder layers that drop transformers' call
    arguments (Nemotron): the attention still reaches the call's caches. Each generates what eager does."""
    # GPT-BigCode derives its KV heads from multi_query (its default: one), as a real config of it has them.
    overrides = {"num_key_value_heads": 1} if model_type == "gpt_bigcode" else {}
    model, tokenizer = build_tiny(tiny_config(model_type, overrides))
    ids = tokenizer(PROMPT).input_ids
    decoder = ExportableDecoder(model, TEST_CACHE_LEN)
    got = greedy_with(torch_forward(decoder), ids, NEW_TOKENS)
    assert_generation_matches(got, eager_reference(model, ids, NEW_TOKENS), FP32_LOGIT_ATOL, model_type)


def test_a_layer_that_attends_twice_is_refused_in_one_line(monkeypatch):
    """Diff-Llama's differential attention (two attention calls per layer, over two halves of its
    values) is refused from its config; lifted, the first call says why, in one line."""
    with pytest.raises(UnsupportedModelError, match="differential-attention"):
        architecture.check_supported(tiny_config("diffllama", {}))
    monkeypatch.delitem(architecture._REFUSED, "diffllama")
    decoder = ExportableDecoder(build_tiny(tiny_config("diffllama", {}))[0], TEST_CACHE_LEN)
    with pytest.raises(UnsupportedModelError, match="its layer 0 calls attention twice per step") as traced:
        decoder(torch.tensor([[1, 2, 3]]), torch.tensor([0]))
    assert "\n" not in str(traced.value)


def test_keys_of_another_shape_than_the_config_gives_are_refused_in_one_line():
    """A config whose KV heads its attention ignores (GPT-2 with ``num_key_value_heads`` set): the
    first call names the layer and both shapes rather than failing inside a cache write."""
    config = tiny_config("gpt2", {})
    config.num_key_value_heads = 2
    decoder = ExportableDecoder(build_tiny(config)[0], TEST_CACHE_LEN)
    with pytest.raises(UnsupportedModelError, match="layer 0's attention computes 4 KV heads of keys of size 16 .* config gives 2 heads"):
        decoder(torch.tensor([[1, 2, 3]]), torch.tensor([0]))
