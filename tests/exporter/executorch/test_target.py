"""The .pte of every preset, run by ExecuTorch, against eager transformers."""

from __future__ import annotations

import pytest
import torch

from kvexport.artifact.manifest import read_manifest
from kvexport.models.presets import build_preset
from kvexport.runtime.programs import load_program

from tests.conftest import NEW_TOKENS, PROMPT, TEST_CACHE_LEN
from tests.helpers import FP32_LOGIT_ATOL, assert_generation_matches, eager_reference, greedy_with


def test_pte_matches_eager_past_the_window(tiny, artifact):
    name, model, tokenizer = tiny
    ids = tokenizer(PROMPT).input_ids
    program = load_program(artifact(name))
    got = greedy_with(program.forward, ids, NEW_TOKENS)
    assert_generation_matches(got, eager_reference(model, ids, NEW_TOKENS), FP32_LOGIT_ATOL, name)


def test_pte_chunked_prefill_and_reuse(artifact):
    model, tokenizer = build_preset("tiny-gemma3")
    ids = tokenizer(PROMPT).input_ids
    program = load_program(artifact("tiny-gemma3"))
    expected = eager_reference(model, ids, NEW_TOKENS)
    for chunks in ([40, 4], [3, 7, 11, 23], [len(ids)]):  # the last one also proves a fresh start works
        got = greedy_with(program.forward, ids, NEW_TOKENS, chunks=chunks)
        assert_generation_matches(got, expected, FP32_LOGIT_ATOL, f"chunks {chunks}")


def test_prefill_chunk_bounds_each_call_and_the_memory_planned_for_it(artifact, tmp_path):
    """--prefill-chunk C: ExecuTorch plans forward's memory for calls of at most C tokens (a call of
    C + 1 is refused), and both kvexport's runner and TextLLMRunner (which reads C as
    get_max_seq_len) prefill a longer prompt in chunks of C with eager's result."""
    from executorch.runtime import Runtime

    from kvexport.exporter.pipeline import ExportOptions, export_model
    from kvexport.progress import Progress

    folder = tmp_path / "chunk5"
    export_model(ExportOptions("tiny-gemma3", "executorch", folder, TEST_CACHE_LEN, prefill_chunk=5), Progress(quiet=True))
    manifest, whole = read_manifest(folder).to_json(), read_manifest(artifact("tiny-gemma3")).to_json()
    assert manifest["export_options"]["prefill_chunk"] == manifest["interface"]["max_tokens_per_call"] == 5
    assert whole["interface"]["max_tokens_per_call"] == TEST_CACHE_LEN  # the default: min(cache, 512)
    assert manifest["planned_memory_bytes"] < whole["planned_memory_bytes"]

    pte = Runtime.get().load_program(folder / "model.pte", data_path=folder / "model.ptd")
    assert pte.load_method("get_max_seq_len").execute([]) == [5]
    forward = pte.load_method("forward")
    forward.execute([torch.zeros((1, 5), dtype=torch.long), torch.tensor([0])])
    with pytest.raises(RuntimeError):
        forward.execute([torch.zeros((1, 6), dtype=torch.long), torch.tensor([0])])

    model, tokenizer = build_preset("tiny-gemma3")
    ids = tokenizer(PROMPT).input_ids
    assert len(ids) > 5
    expected = eager_reference(model, ids, NEW_TOKENS)
    got = greedy_with(load_program(folder).forward, ids, NEW_TOKENS)
    assert_generation_matches(got, expected, FP32_LOGIT_ATOL, "prefill in chunks of 5")
    assert text_llm_runner_text(folder, PROMPT, NEW_TOKENS) == tokenizer.decode(expected[0])


def test_tied_embedding_is_stored_once(artifact):
    """tiny-smollm3 ties its embedding and lm_head: the artifact holds the weights once."""
    model, _ = build_preset("tiny-smollm3")
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    folder = artifact("tiny-smollm3")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding_bytes = model.get_input_embeddings().weight.numel() * 4
    # All weights are in model.ptd, the embedding once (a second copy would add embedding_bytes);
    # model.pte holds the program alone (a copy of the embedding there would take it past the bound).
    assert weight_bytes <= (folder / "model.ptd").stat().st_size < weight_bytes + embedding_bytes
    assert (folder / "model.pte").stat().st_size < 0.15 * weight_bytes < (folder / "model.pte").stat().st_size + embedding_bytes


def test_a_quantized_artifact_s_weights_are_all_in_the_data_file(artifact):
    """The int4 and int8 weights that XNNPACK serializes (a quantized tensor's data, scales and
    offsets, unpacked into placeholders of their own when the program is decomposed) are in
    model.ptd as a float artifact's are: the program holds no named data of its own."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    folder = artifact("tiny-gemma3", "executorch", "8da4w", "int8")
    assert deserialize_pte_binary((folder / "model.pte").read_bytes()).named_data is None
    assert (folder / "model.ptd").stat().st_size > 0


def test_pte_carries_the_runner_metadata(artifact):
    from executorch.runtime import Runtime

    folder = artifact("tiny-gemma3")
    manifest = read_manifest(folder).to_json()
    program = Runtime.get().load_program(folder / "model.pte", data_path=folder / "model.ptd")

    def value(method):
        return program.load_method(method).execute([])

    assert value("get_max_seq_len") == [TEST_CACHE_LEN]
    assert value("get_max_context_len") == [TEST_CACHE_LEN]
    assert value("use_kv_cache") == [True]
    assert value("enable_dynamic_shape") == [True]
    assert value("get_eos_ids") == manifest["eos_token_ids"]


def text_llm_runner_text(folder, prompt: str, new_tokens: int) -> str:
    """What ExecuTorch's own C++ LLM runner (its pip bindings) generates with the .pte, greedily."""
    runner_mod = pytest.importorskip("executorch.extension.llm.runner")
    from kvexport.runtime.executorch_program import register_kernels

    register_kernels()
    pieces: list[str] = []
    runner = runner_mod.TextLLMRunner(str(folder / "model.pte"), str(folder / "tokenizer.json"), str(folder / "model.ptd"))
    # Its tokenizer adds no BOS: the runner prepends one where the model's tokenizer would.
    bos = int(read_manifest(folder).tokenizer_adds_bos)
    config = runner_mod.GenerationConfig(
        max_new_tokens=new_tokens, temperature=0.0, echo=False, num_bos=bos, num_eos=0
    )
    runner.generate(prompt, config, token_callback=pieces.append)
    return "".join(pieces)


# tiny-gemma3: sliding layers, and a prompt longer than their window.
@pytest.mark.parametrize("name", ["tiny-phi3", "tiny-gemma3"])
def test_executorch_text_llm_runner_generates_eager_text(artifact, name):
    """ExecuTorch's own C++ LLM runner (its pip bindings) runs the .pte and agrees with eager."""
    model, tokenizer = build_preset(name)
    eager_ids, _ = eager_reference(model, tokenizer(PROMPT).input_ids, NEW_TOKENS)
    # The stock runner stops at EOS and has no switch to ignore it: this preset/prompt pair has none.
    assert model.config.eos_token_id not in eager_ids, "pick a preset whose greedy output has no EOS"
    assert text_llm_runner_text(artifact(name), PROMPT, NEW_TOKENS) == tokenizer.decode(eager_ids)


def test_lowering_shares_the_programs_weights_rather_than_copying_them():
    """to_edge deep-copies its program: while lowering, that copy must reuse the weights (one less
    copy of the model at the export's peak RSS), and afterwards deepcopy copies again."""
    import copy

    import torch

    from kvexport.exporter.executorch.target import _weights_shared_on_deepcopy

    program = torch.export.export(torch.nn.Linear(4, 3), (torch.ones(1, 4),))
    weight = program.state_dict["weight"]
    with _weights_shared_on_deepcopy([program]):
        assert copy.deepcopy(program).state_dict["weight"] is weight
    assert copy.deepcopy(program).state_dict["weight"] is not weight
    assert "__deepcopy__" not in weight.__dict__


def test_weights_serialized_while_lowering_wait_on_disk(artifact, tmp_path, monkeypatch):
    """XNNPACK's serialized weights go to files (not memory) until model.ptd is written; the artifact
    is the same bytes as one lowered in memory, and no spill file is left behind."""
    import torch
    from executorch.exir._serialize._cord import FileBackedData

    from kvexport.exporter.pipeline import ExportOptions, export_model
    from kvexport.exporter.executorch import target as executorch
    from kvexport.progress import Progress

    model, _ = build_preset("tiny-smollm3")
    # The session's artifact was lowered in memory: no weight of this tiny model reaches the threshold.
    assert max(p.numel() * p.element_size() for p in model.parameters()) < executorch.SPILL_MIN_BYTES
    in_memory = artifact("tiny-smollm3")

    written_from_disk = []
    write_to_file = FileBackedData.write_to_file
    monkeypatch.setattr(FileBackedData, "write_to_file", lambda self, f: written_from_disk.append(len(self)) or write_to_file(self, f))
    monkeypatch.setattr(executorch, "SPILL_MIN_BYTES", 0)  # everything spilled
    spilled = tmp_path / "spilled"
    export_model(ExportOptions("tiny-smollm3", "executorch", spilled, TEST_CACHE_LEN), Progress(quiet=True))

    # Every linear layer is XNNPACK's; the tied lm_head's weight is written once, from the lookup's copy.
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not model.get_output_embeddings()]
    assert sum(written_from_disk) >= sum(m.weight.numel() * 4 for m in linears)
    for name in ("model.pte", "model.ptd"):
        assert (spilled / name).read_bytes() == (in_memory / name).read_bytes(), name
    assert sorted(p.name for p in spilled.iterdir()) == sorted(p.name for p in in_memory.iterdir())


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-mistral"])
def test_bfloat16_pte_passes_check(artifact, name):
    """bfloat16, float32's range in half its bytes (Gemma 3, which overflows float16): rings and a full
    layer through the custom ops (Gemma 3), a ring through ``custom_sdpa`` with a mask (Mistral)."""
    from kvexport.checker.check import run_check

    report = run_check(artifact(name, dtype="bfloat16"))
    assert report.ok and report.dtype == "bfloat16", report
    assert all(p.compared_steps == p.new_tokens for p in report.prompts)


def test_float16_pte_passes_check_where_the_ring_goes_through_custom_sdpa(artifact):
    """tiny-mistral's sliding layers have several KV heads, so their ring is attended by
    ``llama::custom_sdpa`` with a mask, which the kernel takes in float32 only: a float16 mask made
    every float16 .pte of such a model fail at its first call."""
    from kvexport.checker.check import run_check

    report = run_check(artifact("tiny-mistral", dtype="float16"))
    assert report.ok and report.dtype == "float16", report
    assert all(p.compared_steps == p.new_tokens for p in report.prompts)
