"""Runs an ONNX artifact's folder with onnxruntime-genai, the stock runtime for ONNX LLMs (what an
app in C#, Java, Swift or C++ embeds): ``og.Model(folder)`` reads the ``genai_config.json`` the
exporter wrote, allocates the cache itself and feeds the graph.

The same ``forward(tokens, start) -> logits`` as kvexport's own runner, so ``run``, ``chat`` and
``check`` drive either: a call is ``Generator.append_tokens`` (genai runs the graph on the new
tokens) and its logits ``Generator.get_logits``. A sequence is one generator; a call at position
0 starts a new one (genai cannot rewind a sliding layer's cache once it has evicted).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..artifact.manifest import Manifest
from ..errors import ArtifactError, InvalidOptionError, KvexportError
from .cpu import runtime_threads
from .generation import check_call
from .onnx_artifact import check_against_genai_config, check_runs_on

PACKAGE = "onnxruntime-genai"


def _import_genai(manifest: Manifest):
    try:
        import onnxruntime_genai
    except ModuleNotFoundError as e:
        version = manifest.version("onnxruntime_genai")
        raise KvexportError(f"--runner genai needs {PACKAGE} ({e.name} is not installed): "
                            f"pip install {PACKAGE}{'==' + version if version else ''}")
    return onnxruntime_genai


def set_genai_threads(config, threads: int) -> None:
    """The decoder session of an ``og.Config`` to ``threads`` intra-op threads (inter-op 1)."""
    options = {"intra_op_num_threads": threads, "inter_op_num_threads": 1}
    config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))


class GenaiProgram:
    def __init__(self, folder: Path, manifest: Manifest, device: str):
        if manifest.target != "onnx":
            raise InvalidOptionError(f"--runner genai runs ONNX artifacts; this one is {manifest.target}")
        if manifest.genai_unsupported is not None:
            raise InvalidOptionError(
                f"--runner genai: {PACKAGE} cannot run {folder}: {manifest.genai_unsupported}; "
                "run it with kvexport's runner (--runner kvexport, the default)"
            )
        if manifest.genai_config is None:
            raise ArtifactError(f"{folder} has no genai_config.json (an ONNX artifact of another kvexport); re-export it")
        if device not in ("cpu", "cuda"):
            raise InvalidOptionError(f"unknown device '{device}'; ONNX artifacts run on cpu or cuda")
        if manifest.files:  # a kvexport artifact (scripts/genai_agreement.py also runs other folders)
            check_against_genai_config(folder, manifest)
        check_runs_on(manifest, device)  # what onnxruntime's kernels take, as for kvexport's runner
        og = _import_genai(manifest)
        config = og.Config(str(folder))
        config.clear_providers()
        if (threads := runtime_threads()) is not None:
            set_genai_threads(config, threads)
        if device == "cuda":
            if not og.is_cuda_available():  # else og.Model fails later with a message about the folder
                raise InvalidOptionError(f"--runner genai --device cuda: this {PACKAGE} ({og.__version__}) has no CUDA; "
                                         f"install {PACKAGE}-cuda=={og.__version__} in its place on a machine with an "
                                         "NVIDIA GPU, or use --device cpu")
            config.append_provider("cuda")
        try:
            self._model = og.Model(config)
        except Exception as e:  # genai raises RuntimeError with its own first line
            raise ArtifactError(f"{PACKAGE} cannot load {folder}: {(str(e).strip().splitlines() or [type(e).__name__])[0]}")
        self._og = og
        self.manifest = manifest
        self._max_cache_len = manifest.max_cache_len
        self._generator = None
        self._next_start = 0

    def forward(self, tokens: list[int], start: int) -> np.ndarray:
        check_call(tokens, start, self._next_start, self._max_cache_len)
        if start == 0 or self._generator is None:
            params = self._og.GeneratorParams(self._model)
            params.set_search_options(max_length=self._max_cache_len)
            self._generator = self._og.Generator(self._model, params)
        self._generator.append_tokens(np.asarray(tokens, dtype=np.int32))
        self._next_start = start + len(tokens)
        return np.asarray(self._generator.get_logits(), dtype=np.float32).reshape(-1)[-self.manifest.vocab_size:]

    def reset(self) -> None:
        self._generator, self._next_start = None, 0


def load(folder: Path, manifest: Manifest, device: str) -> GenaiProgram:
    return GenaiProgram(Path(folder), manifest, device)
