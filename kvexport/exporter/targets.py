"""Export targets, one module each. A target module provides:

- ``SUPPORTED_DTYPES``: the ``--dtype`` values it takes;
- ``RUNTIME_PACKAGES``: the packages whose versions ``kvexport.json`` records;
- ``export(model, max_cache_len, max_tokens_per_call) -> ExportedProgram``: the model wrapped
  with the target's cache and traced;
- ``lower(program, metadata, out_dir) -> dict``: write the program file(s) into ``out_dir`` and
  return facts for ``kvexport.json`` (at least ``program``, the main file's name).
"""

from __future__ import annotations

import importlib

from ..artifact.manifest import TARGETS
from ..errors import InvalidOptionError


def get_target(name: str):
    if name not in TARGETS:
        raise InvalidOptionError(f"unknown target '{name}'; choose one of: {', '.join(TARGETS)}")
    module = f"{__package__}.{name}.target"
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name not in (module, module.rsplit(".", 1)[0]):  # the target exists but a dependency is missing: a bug
            raise
        raise InvalidOptionError(f"target '{name}' is not built in this version of kvexport; use --target executorch or --target onnx")
