"""ExecuTorch's Python runtime, imported without its exporter."""

from __future__ import annotations

import subprocess
import sys

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
