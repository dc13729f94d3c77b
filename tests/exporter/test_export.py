"""torch.export of the wrapper: one program, exact, with nothing that depends on the step."""

from __future__ import annotations

import torch

from kvexport.exporter.decoder import ExportableDecoder, export_decoder
from kvexport.models.presets import build_preset

from tests.conftest import NEW_TOKENS, PROMPT, TEST_CACHE_LEN
from tests.helpers import FP32_LOGIT_ATOL, assert_generation_matches, eager_reference, greedy_with, torch_forward


def test_exported_program_matches_eager(tiny):
    name, model, tokenizer = tiny
    ids = tokenizer(PROMPT).input_ids
    expected = eager_reference(model, ids, NEW_TOKENS)
    program = export_decoder(ExportableDecoder(model, TEST_CACHE_LEN))
    got = greedy_with(torch_forward(program.module()), ids, NEW_TOKENS)
    assert_generation_matches(got, expected, FP32_LOGIT_ATOL, name)


def test_program_has_one_dynamic_dim_and_no_step_state():
    model, _ = build_preset("tiny-gemma3")
    program = export_decoder(ExportableDecoder(model, TEST_CACHE_LEN))
    # The only symbol is the token count T, bounded by the cache; the position is a tensor input.
    # (torch.export reports backed sizes from 2; T = 1 runs the same graph, as the decode tests show.)
    ranges = list(program.range_constraints.values())
    assert len(ranges) == 1, program.range_constraints
    assert int(ranges[0].lower) <= 2 and int(ranges[0].upper) == TEST_CACHE_LEN
    # All the state is in the cache buffers, which the (functionalized) program mutates.
    mutated = set(program.run_decompositions({}).graph_signature.buffers_to_mutate.values())
    assert mutated == {f"caches.{i}.{kv}" for i in range(model.config.num_hidden_layers) for kv in "kv"}


def test_decoding_many_steps_never_recompiles():
    """The failure of transformers' StaticSlidingWindowLayer (a recompile per step) does not happen."""
    from torch._dynamo.testing import CompileCounter

    model, tokenizer = build_preset("tiny-gemma3")
    decoder = ExportableDecoder(model, TEST_CACHE_LEN)
    counter = CompileCounter()
    compiled = torch.compile(decoder, backend=counter, fullgraph=True, dynamic=True)
    ids = tokenizer(PROMPT).input_ids
    torch._dynamo.reset()
    got = greedy_with(torch_forward(compiled), ids, 3)  # prefill + the first decode shapes
    compiles = counter.frame_count
    greedy_with(torch_forward(compiled), ids, TEST_CACHE_LEN - len(ids))  # 20 decode steps, past the window
    assert counter.frame_count == compiles, f"{counter.frame_count - compiles} recompiles while decoding"
    assert got[0] == eager_reference(model, ids, 3)[0]
