"""Speculative decoding: drafters, the verification loop, and artifacts that verify drafted tokens
(``--max-draft-tokens``) on both targets: every position's logits, and calls that start again after
rejected drafts, as exact as plain decoding."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvexport.checker.check import run_check
from kvexport.errors import InvalidOptionError, UnsupportedModelError
from kvexport.exporter.pipeline import ExportOptions, plan_export
from kvexport.runtime.generation import generate
from kvexport.runtime.programs import load_program
from kvexport.runtime.speculation import ModelDrafter, PromptLookup, generate_with_draft, load_drafter

from tests.conftest import PROMPT
from tests.helpers import FP32_LOGIT_ATOL, INT8_KV_LOGIT_ATOL, assert_one_line_error, fake_manifest, run_cli

DRAFTS = 4


def test_prompt_lookup_proposes_what_followed_the_latest_match_of_the_longest_tail():
    lookup = PromptLookup(max_ngram=3)
    context = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert lookup.propose(context, 2) == [7, 8]  # the latest [1, 2, 3] was followed by 7, 8
    assert lookup.propose([4, 5, 6, 4], 3) == [5, 6, 4]  # a 1-token tail where no longer one recurs
    assert lookup.propose([1, 2, 3], 4) == []


class TableModel:
    """A program whose next-token logits are a fixed function of the last two tokens, with
    ``verify`` as the calls it stands for would give them: the loop's arithmetic, without a model."""

    def __init__(self, vocab: int = 7, max_cache_len: int = 200):
        rng = np.random.default_rng(1)
        self.table = rng.normal(size=(vocab, vocab, vocab)).astype(np.float32)
        self.manifest = fake_manifest(max_cache_len=max_cache_len, max_draft_tokens=DRAFTS, vocab_size=vocab)
        self.context: list[int] = []
        self.calls = 0

    def _logits(self, upto: int) -> np.ndarray:
        a, b = self.context[max(upto - 2, 0)], self.context[upto - 1]
        return self.table[a, b]

    def forward(self, tokens, start):
        self.calls += 1
        self.context[start:] = tokens
        return self._logits(len(self.context))

    def verify(self, tokens, start):
        self.calls += 1
        self.context[start:] = tokens
        return np.stack([self._logits(start + i + 1) for i in range(len(tokens))])


class RandomDrafter:
    """Drafts that are right with probability ``p`` (the model's own next tokens), else random."""

    def __init__(self, model: TableModel, p: float, seed: int):
        self.model, self.p, self.rng = model, p, np.random.default_rng(seed)

    def prefill(self, prompt_ids):
        pass

    def propose(self, context, k):
        drafts, ctx = [], list(context)
        for _ in range(int(self.rng.integers(0, k + 1))):
            right = int(np.argmax(self.model.table[ctx[-2] if len(ctx) > 1 else ctx[-1], ctx[-1]]))
            token = right if self.rng.random() < self.p else int(self.rng.integers(0, 7))
            drafts.append(token)
            ctx.append(token)
        return drafts


@settings(max_examples=100, deadline=None)
@given(p=st.floats(0, 1), seed=st.integers(0, 2**16), new=st.integers(1, 60), prompt=st.lists(st.integers(0, 6), min_size=1, max_size=8))
def test_speculative_generation_chooses_the_tokens_plain_greedy_does(p, seed, new, prompt):
    plain = generate(TableModel(), prompt, new)
    model = TableModel()
    seen = []

    def note(step: int, logits: np.ndarray) -> bool:
        seen.append(step)
        return True

    fast = generate_with_draft(model, prompt, new, RandomDrafter(model, p, seed), DRAFTS, on_logits=note)
    assert fast.new_ids == plain.new_ids
    assert seen == list(range(new))  # one logits row per new token, in order
    spec = fast.speculation
    assert spec.accepted <= spec.drafted and model.calls == 1 + spec.calls + spec.plain_calls


def test_speculation_stops_at_eos_inside_the_accepted_drafts():
    model = TableModel()
    plain = generate(TableModel(), [1, 2], 40)
    eos = plain.new_ids[5]
    first = plain.new_ids.index(eos)
    fast = generate_with_draft(model, [1, 2], 40, RandomDrafter(model, 1.0, 0), DRAFTS, eos_ids={eos})
    assert fast.new_ids == plain.new_ids[: first + 1] and fast.stopped_by == "eos"


@pytest.mark.parametrize("target", ["executorch", "onnx"])
@pytest.mark.parametrize(("preset", "kv_cache"), [("tiny-gemma3", "float"), ("tiny-llama", "float"), ("tiny-gemma3", "int8")])
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_verification_and_calls_after_rejected_drafts_equal_plain_calls(artifact, target, preset, kv_cache, data):
    """Random acceptance patterns on a real artifact (tiny Gemma 3: a ring of 6 slots past which the
    calls run, float or int8; tiny Llama: full layers): each verification's rows equal the logits
    plain one-token calls give (within XNNPACK's reordering of a multi-token call), and after going
    back over the rejected drafts the next call's logits too."""
    folder = artifact(preset, target, kv_cache=kv_cache, max_draft_tokens=DRAFTS)
    program, plain = load_program(folder), load_program(folder)
    atol = FP32_LOGIT_ATOL if kv_cache == "float" else INT8_KV_LOGIT_ATOL
    tokens = data.draw(st.lists(st.integers(3, 90), min_size=48, max_size=48), label="tokens")
    program.forward(tokens[:5], 0)
    plain.forward(tokens[:5], 0)
    start = 5
    while start < 40:
        n = data.draw(st.integers(1, DRAFTS + 1), label="call")
        kept = data.draw(st.integers(1, n), label="kept")
        junk = [(t * 7 + 1) % 97 for t in tokens[start + kept : start + n]]  # rejected: tokens of another sequence
        rows = program.verify(tokens[start : start + kept] + junk, start)
        expected = [plain.forward([t], start + i) for i, t in enumerate(tokens[start : start + kept])]
        np.testing.assert_allclose(rows[:kept], np.stack(expected), atol=atol, rtol=0)
        start += kept
    np.testing.assert_allclose(program.forward(tokens[start : start + 3], start), plain.forward(tokens[start : start + 3], start),
                               atol=atol, rtol=0)


@pytest.mark.parametrize("target", ["executorch", "onnx"])
def test_check_with_prompt_lookup_and_with_a_4bit_drafter_finds_eager_tokens(artifact, target):
    """``check --draft``: the artifact generates speculatively past the window, and every token is eager's."""
    folder = artifact("tiny-gemma3", target, max_draft_tokens=DRAFTS)
    quantize = "8da4w" if target == "executorch" else "int4"
    drafter = artifact("tiny-gemma3", target, quantize=quantize, max_draft_tokens=DRAFTS)
    for draft in ("ngram", str(drafter)):
        report = run_check(folder, [(PROMPT, 20)], draft=draft, draft_tokens=3)
        assert report.ok, report.prompts[0]
        spec = report.prompts[0].speculation
        assert spec["verify_calls"] > 0 and 0 < spec["accepted"] <= spec["drafted"]


def test_a_drafter_of_full_layers_needs_no_max_draft_tokens(artifact):
    """``check --draft``: tiny Llama's 4-bit folder, exported plainly, drafts for its verifying
    float32 one, and every token is eager's."""
    drafter = artifact("tiny-llama", "onnx", quantize="int4")
    report = run_check(artifact("tiny-llama", "onnx", max_draft_tokens=DRAFTS), [(PROMPT, 20)], draft=str(drafter), draft_tokens=3)
    assert report.ok, report.prompts[0]
    spec = report.prompts[0].speculation
    assert spec["verify_calls"] > 0 and 0 < spec["accepted"] < spec["drafted"]


def test_onnx_sessions_leave_the_cores_when_a_call_returns(artifact):
    """Every ONNX Runtime session's threads stop spin-waiting when its call returns: a drafter's and
    the verifying program's calls alternate, and threads still spinning after one call would take
    the cores from the next (docs/speculative.md)."""
    folder = artifact("tiny-llama", "onnx", quantize="int4")

    def stops_spinning(program) -> str | None:
        """The session's own setting; None where it has none (ONNX Runtime's default: spin on)."""
        try:
            return program._session.get_session_options().get_session_config_entry("session.force_spinning_stop")
        except RuntimeError:  # "SessionOptions does not have configuration with key"
            return None

    with contextlib.ExitStack() as stack:
        assert stops_spinning(load_drafter(str(folder), stack).program) == "1"
    assert stops_spinning(load_program(folder)) == "1"


def recorded_starts(drafter: ModelDrafter) -> list[int]:
    """The start of every call the drafter's program gets from now on, appended as it is made."""
    starts = []
    forward = drafter.program.forward
    drafter.program.forward = lambda tokens, start: starts.append(start) or forward(tokens, start)
    return starts


@pytest.mark.parametrize(("preset", "drafts"), [("tiny-gemma3", DRAFTS), ("tiny-gemma3", 0), ("tiny-llama", 0)],
                         ids=["ring-spare-slots", "ring", "full-layers"])
def test_a_drafting_artifact_goes_back_over_its_own_rejected_drafts(artifact, preset, drafts):
    """A model drafter keeps its cache in step: after each verification it starts again after the
    accepted tokens (a ring within its own max_draft_tokens, or, exported without them, from the
    evicted rows the ONNX runner keeps; full layers anywhere) and drafts what a fresh program would,
    never feeding the context from 0 again."""
    folder = artifact(preset, "onnx", max_draft_tokens=drafts)
    drafter = ModelDrafter(load_program(folder))
    drafter.reach_back(DRAFTS - 1)
    assert drafter.exact
    starts = recorded_starts(drafter)
    context = list(range(10, 40))
    for accepted in (0, 2, 3, 1):
        drafts = drafter.propose(context, DRAFTS)
        fresh = ModelDrafter(load_program(folder)).propose(context, DRAFTS)
        assert drafts == fresh
        context = context + drafts[:accepted] + [(drafts[accepted] + 1) % 90 if accepted < DRAFTS else 5]
    assert starts.count(0) == 1


@pytest.mark.parametrize("target", ["executorch", "onnx"])
@pytest.mark.parametrize("kv_cache", ["float", "int8"])
def test_full_layers_go_back_anywhere_without_max_draft_tokens(artifact, target, kv_cache):
    """An artifact whose layers are all full ones (tiny Llama) goes back without
    ``--max-draft-tokens``: a call from an earlier position writes its rows again and attention reads
    none past them, so it gives what a program that never went further gives (the same bits, where
    the rows before the call came from the same calls)."""
    folder = artifact("tiny-llama", target, kv_cache=kv_cache)
    program, fresh = load_program(folder), load_program(folder)
    assert program.manifest.max_draft_tokens == 0 and program.manifest.rewind == program.manifest.max_cache_len
    tokens = list(range(10, 40))
    program.forward(tokens[:12], 0)
    program.forward([(t * 7 + 1) % 97 for t in tokens[12:20]], 12)  # another sequence's tokens, then back
    fresh.forward(tokens[:12], 0)
    np.testing.assert_array_equal(program.forward(tokens[12:16], 12), fresh.forward(tokens[12:16], 12))
    # Further back, into rows a longer call wrote: as a fresh program's, within XNNPACK's reordering
    # of a call of another length.
    fresh = load_program(folder)
    fresh.forward(tokens[:3], 0)
    np.testing.assert_allclose(program.forward(tokens[3:10], 3), fresh.forward(tokens[3:10], 3), atol=FP32_LOGIT_ATOL, rtol=0)


def test_a_pte_ring_drafter_without_spare_slots_drafts_on_and_check_finds_eager_tokens(artifact):
    """tiny Gemma 3's plain 8da4w ``.pte`` (a ring of 6 slots, none spare) drafts for its verifying
    float32 one past the window: it goes back over rejected drafts without feeding from 0 again,
    inexactly (``exact`` False: the drafts may differ, the tokens kept may not), and every token is eager's."""
    drafter = artifact("tiny-gemma3", "executorch", quantize="8da4w")
    drafting = ModelDrafter(load_program(drafter))
    drafting.reach_back(DRAFTS - 1)
    assert not drafting.exact and drafting.rewind == DRAFTS - 1
    starts = recorded_starts(drafting)
    context = list(range(10, 40))
    for accepted in (0, 2, 3, 1):
        drafts = drafting.propose(context, DRAFTS)
        assert len(drafts) == DRAFTS
        context = context + drafts[:accepted] + [(drafts[accepted] + 1) % 90]
    assert starts.count(0) == 1
    report = run_check(artifact("tiny-gemma3", "executorch", max_draft_tokens=DRAFTS), [(PROMPT, 20)], draft=str(drafter),
                       draft_tokens=DRAFTS)
    assert report.ok, report.prompts[0]
    spec = report.prompts[0].speculation
    assert spec["verify_calls"] > 0 and 0 < spec["accepted"] < spec["drafted"]


@pytest.mark.parametrize("target", ["executorch", "onnx"])
def test_a_drafter_that_cannot_go_back_is_refused_in_one_line(artifact, target):
    """A drafting artifact with a state (tiny LFM2's convolutions) cannot forget rejected drafts."""
    drafter = ModelDrafter(load_program(artifact("tiny-lfm2", target)))
    drafter.reach_back(0)  # one draft a verification: nothing to go back over
    with pytest.raises(InvalidOptionError, match="cannot go back over rejected drafts"):
        drafter.reach_back(DRAFTS - 1)


def test_genai_runs_a_verifying_folder_as_a_plain_one(artifact):
    """``logits_indices`` has a default (the last position), so onnxruntime-genai, which does not
    know it, runs the folder and generates eager's tokens."""
    report = run_check(artifact("tiny-gemma3", "onnx", max_draft_tokens=DRAFTS), [(PROMPT, 20)], runner="genai")
    assert report.ok


@pytest.mark.parametrize(("preset", "kind"), [("tiny-gemma3n", "another layer's cache"), ("tiny-lfm2", "a state"),
                                              ("tiny-llama4", "a chunked-attention ring")], ids=["shared", "state", "chunked"])
def test_layers_that_cannot_go_back_are_refused_before_loading(preset, kind):
    with pytest.raises(UnsupportedModelError, match=kind):
        plan_export(ExportOptions(preset, "onnx", max_cache_len=64, max_draft_tokens=2))


def test_draft_options_are_checked_in_one_line(artifact, tmp_path, capsys):
    with pytest.raises(InvalidOptionError, match="--prefill-chunk 4"):
        plan_export(ExportOptions("tiny-llama", "onnx", tmp_path / "a", max_cache_len=64, prefill_chunk=4, max_draft_tokens=4))
    plain = artifact("tiny-llama", "onnx")
    folder = artifact("tiny-llama", "onnx", max_draft_tokens=DRAFTS)
    for args, phrase in [((plain, "--max-new-tokens", 4), "--max-draft-tokens"), ((folder, "--draft-tokens", 9), "--draft-tokens"),
                         ((folder, "--temperature", 0.7), "greedily")]:
        code, _, err = run_cli(capsys, "run", *args, "-p", "hi", "--draft", "ngram")
        assert_one_line_error(code, err, phrase)
    program = load_program(artifact("tiny-gemma3", "onnx", max_draft_tokens=DRAFTS))  # a ring's spare slots
    program.forward([5, 6, 7, 8, 9, 10, 11, 12], 0)
    with pytest.raises(InvalidOptionError, match="up to 4 positions before"):
        program.forward([5], 2)  # further back than any verification reaches
