"""ExecuTorch's Python runtime: imported without its exporter; XNNPACK's weight cache."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

_RUNTIME_THEN_EXPORTER = """
import sys
from kvexport.runtime.executorch_program import register_kernels
register_kernels()
assert "executorch.extension.pybindings.portable_lib" in sys.modules
assert not [name for name in sys.modules if name.startswith("executorch.exir")], "the exporter was imported"
import executorch.exir
from executorch.exir import to_edge_transform_and_lower
from executorch.exir._warnings import ExperimentalWarning
assert executorch.exir.__file__ and executorch.exir._warnings.ExperimentalWarning is ExperimentalWarning
"""


def test_the_runtime_loads_without_the_exporter_which_a_later_import_gets_whole():
    """The stand-in that keeps ``executorch.exir``'s ``__init__`` from running while the runtime imports
    is gone after: the same process can still export."""
    done = subprocess.run([sys.executable, "-c", _RUNTIME_THEN_EXPORTER], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_forward_and_verify_share_packed_weights_with_the_same_results(artifact, monkeypatch):
    """A `.pte` runs with XNNPACK's weight cache on (``xnnpack_options``: its two methods pack each
    weight once), and gives the same logits, bit for bit, as one loaded with it off."""
    from kvexport.runtime import executorch_program, xnnpack_options
    from kvexport.runtime.programs import load_program

    folder = artifact("tiny-gemma3", "executorch", max_draft_tokens=4)
    prompt = [5, 17, 3, 42, 9, 11]

    def logits() -> np.ndarray:
        program = load_program(folder)
        return np.concatenate([program.forward(prompt, 0)[None], program.verify([8, 1, 2], len(prompt))])

    shared = logits()
    assert xnnpack_options.get_bool(xnnpack_options.WEIGHT_CACHE) is True
    assert xnnpack_options.set_bool(xnnpack_options.WEIGHT_CACHE, False)
    monkeypatch.setattr(executorch_program, "set_bool", lambda key, value: False)  # the program leaves it off
    try:
        apart = logits()
        assert xnnpack_options.get_bool(xnnpack_options.WEIGHT_CACHE) is False
    finally:
        xnnpack_options.set_bool(xnnpack_options.WEIGHT_CACHE, True)
    np.testing.assert_array_equal(shared, apart)


def test_a_bfloat16_pte_loads_with_the_weight_cache_off(artifact):
    """ExecuTorch 1.5.1's runtime crashes loading a bfloat16 `.pte`'s delegates with XNNPACK's weight
    cache on: such a program is loaded with it off (in a subprocess, which a crash would end)."""
    folder = artifact("tiny-gemma3", "executorch", dtype="bfloat16")
    code = (
        "import sys; from kvexport.runtime.programs import load_program; from kvexport.runtime import xnnpack_options as x;"
        f"p = load_program({str(folder)!r}); p.forward([5, 6, 7], 0); sys.exit(0 if x.get_bool(x.WEIGHT_CACHE) is False else 3)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_verification_costs_the_tokens_it_verifies_and_an_older_pte_is_padded(artifact):
    """``verify`` takes calls of any length up to ``max_draft_tokens + 1`` (``verify_tokens`` in the
    manifest): the runner passes a verification's own tokens. A `.pte` whose manifest lacks it was
    exported with ``verify`` of that length exactly, and gets its verifications padded; the rows the
    verification asked for are the same either way."""
    from kvexport.runtime.programs import load_program

    folder = artifact("tiny-gemma3", "executorch", max_draft_tokens=4)
    prompt = [5, 17, 3, 42, 9, 11]

    def verified(program) -> tuple[np.ndarray, list[list[int]]]:
        method, calls = program._verify_method(), []

        class Recorded:
            def execute(self, inputs):
                calls.append(list(inputs[0].shape))
                return method.execute(inputs)

        program._verify = Recorded()
        program.forward(prompt, 0)
        return program.verify([8, 1, 2], len(prompt)), calls

    program = load_program(folder)
    assert program.manifest.facts["verify_tokens"] == 5
    rows, calls = verified(program)
    assert calls == [[1, 3]]
    older = load_program(folder)
    del older.manifest.facts["verify_tokens"]
    padded_rows, padded_calls = verified(older)
    assert padded_calls == [[1, 5]]
    assert rows.shape == padded_rows.shape == (3, older.manifest.vocab_size)
    np.testing.assert_allclose(rows, padded_rows, atol=1e-5, rtol=0)
