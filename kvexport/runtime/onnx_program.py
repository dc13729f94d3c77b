"""Runs ``model.onnx`` with ONNX Runtime, the KV cache held in buffers this runner owns.

numpy and onnxruntime only (no torch, no transformers), so an ONNX folder runs where neither is
installed. The graph's interface is in ``kvexport.json`` (``interface``); in short, per layer a key
and a value buffer, allocated once, zero-filled, where the session runs (host memory on CPU,
device memory on CUDA), and bound with IOBinding to raw pointers into them, so nothing is copied
in or out by Python:

every buffer is bound once as both its layer's past and its present, and ONNX Runtime's
GroupQueryAttention writes the call's rows in place and reads only the rows it attends to:

- a static layer's buffer ``[1, kv_heads, max_cache_len, head_dim]``: rows ``0 .. start+T-1``,
  so a decode step costs the filled length, whatever ``max_cache_len`` is;
- a sliding layer's ring buffer ``[1, kv_heads, 2 * window, head_dim]``: the last ``window`` rows
  up to each query. The rows stay contiguous in positions: the call's first token goes to row
  ``ring_start`` (the rows in use), and a call that would run past the last row first moves the
  last ``window - 1`` rows to the top, once every ~window tokens. Calls carry at most ``window``
  tokens; a longer prompt goes in as several calls.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..artifact.manifest import MANIFEST, program_mismatch
from ..errors import ArtifactError, InvalidOptionError, PromptTooLongError
from .programs import max_tokens_per_call

_GPU_HINT = "install onnxruntime-gpu (pip install 'kvexport[gpu]') on a machine with an NVIDIA GPU, or use --device cpu"


def _check_runs_on_cuda(manifest: dict) -> None:
    """What onnxruntime-gpu 1.31 gets wrong on CUDA (docs/onnx.md), refused before it runs."""
    if manifest["dtype"] != "float16":
        # Its CUDA GroupQueryAttention takes float16 (and bfloat16) only: a float32 graph's
        # attention runs on the CPU provider, with copies across, and every step after the first
        # reads a wrong cache.
        raise InvalidOptionError(
            f"--device cuda runs float16 ONNX artifacts; this one is {manifest['dtype']}: "
            "export it with --dtype float16 for the GPU, or run it with --device cpu"
        )
    if manifest["format_version"] < 5:  # its graph computes the kernels' total lengths itself
        raise InvalidOptionError(
            f"--device cuda: this ONNX artifact (format version {manifest['format_version']}) computes its "
            "attention lengths inside the graph, which onnxruntime-gpu gets wrong; re-export it with this "
            "kvexport, or run it with --device cpu"
        )


# ONNX Runtime's element types of the manifest's dtypes.
_ORT_TYPES = {"float32": "tensor(float)", "float16": "tensor(float16)", "bfloat16": "tensor(bfloat16)"}


def _check_onnx_fields(manifest: dict) -> None:
    """What an ONNX artifact's manifest has besides the fields every artifact has (``read_manifest``
    checked their types where present): this runner names and sizes the buffers from them."""
    lacks = [key for key in ("interface", "external_data") if key not in manifest]
    lacks += [f"interface.{key}" for key in ("inputs", "outputs") if not lacks and key not in manifest["interface"]]
    lacks += [
        f"layers[{i}].{field}"
        for i, layer in enumerate(manifest["layers"])
        for field in ("index", "kv_heads", "head_dim")
        if field not in layer
    ]
    if lacks:
        raise ArtifactError(f"{MANIFEST} lacks {lacks[0]}, which an ONNX artifact has; the manifest was edited or damaged, re-export")


def _check_against_graph(session, manifest: dict) -> None:
    """Refuse a manifest that does not describe the graph: the buffers and logits this runner sizes
    from it would not fit the graph's inputs (ONNX Runtime fails mid-generation), or, worse, would."""
    graph = {t.name: t for t in session.get_inputs()}
    outputs = {t.name: t for t in session.get_outputs()}
    said = [entry["name"] for entry in manifest["interface"]["inputs"]]
    if sorted(said) != sorted(graph):
        raise program_mismatch("the graph's inputs are", ", ".join(said), ", ".join(graph))
    layers = manifest["layers"]
    in_graph = sum(name.startswith("past_key_") for name in graph)
    if len(layers) != in_graph:
        raise program_mismatch("the model has", f"{len(layers)} layers", f"{in_graph}")
    if "logits" not in outputs:
        raise program_mismatch("the graph has", "an output logits", "none")
    expected_type = _ORT_TYPES[manifest["dtype"]]
    if outputs["logits"].type != expected_type:
        raise program_mismatch("its dtype is", manifest["dtype"], f"logits of {outputs['logits'].type}")
    _check_shape("logits", [1, manifest["vocab_size"]], outputs["logits"].shape, "vocab_size")
    for spec in layers:
        rows = manifest["max_cache_len"] if spec["cache"] == "static" else 2 * spec["window"]
        shape = [1, spec["kv_heads"], rows, spec["head_dim"]]
        fields = f"layers[{spec['index']}]'s kv_heads, head_dim and " + ("max_cache_len" if spec["cache"] == "static" else "window")
        for kv in ("key", "value"):
            name = f"past_{kv}_{spec['index']}"
            if name not in graph or f"present_{kv}_{spec['index']}" not in outputs:
                raise program_mismatch("the graph has", name, "no such input")
            if graph[name].type != expected_type:
                raise program_mismatch("its dtype is", manifest["dtype"], f"{name} of {graph[name].type}")
            _check_shape(name, shape, graph[name].shape, fields)


def _check_shape(name: str, said: list[int], has: list, fields: str) -> None:
    # A symbolic dimension (a name, or None) takes any size.
    if len(said) != len(has) or any(isinstance(h, int) and h != s for s, h in zip(said, has)):
        raise program_mismatch(f"(by its {fields}) {name} is", said, list(has))


class _Buffer:
    """One layer's key or value buffer, zero-filled, where the session runs."""

    def __init__(self, ort, shape: tuple[int, ...], dtype: np.dtype, device: str):
        zeros = np.zeros(shape, dtype=dtype)
        self.device = device
        if device == "cpu":
            self.array = zeros
            self.ptr = zeros.ctypes.data
        else:
            self.value = ort.OrtValue.ortvalue_from_numpy(zeros, device, 0)
            self.ptr = self.value.data_ptr()

    def move_rows(self, first: int, count: int) -> None:
        """Rows ``first .. first+count-1`` to ``0 .. count-1`` (head-major: rows are axis 2)."""
        if self.device == "cpu":
            self.array[:, :, :count] = self.array[:, :, first : first + count]  # numpy copies overlaps safely
        else:  # no device-side copy without a framework: a round trip, once every ~window tokens
            rows = self.value.numpy()
            rows[:, :, :count] = rows[:, :, first : first + count]
            self.value.update_inplace(rows)


class _Layer:
    def __init__(self, ort, spec: dict, max_cache_len: int, dtype: np.dtype, device: str):
        self.index = spec["index"]
        self.window = spec["window"] if spec["cache"] == "ring" else None
        rows = max_cache_len if self.window is None else 2 * self.window
        self.shape = [1, spec["kv_heads"], rows, spec["head_dim"]]  # GroupQueryAttention's layout
        self.buffers = {kv: _Buffer(ort, tuple(self.shape), dtype, device) for kv in ("key", "value")}


class OnnxProgram:
    def __init__(self, folder: Path, manifest: dict, device: str, threads: int | None = None):
        """``threads``: ONNX Runtime's intra-op threads (default: its own choice, one per physical core)."""
        import onnxruntime as ort

        if device not in ("cpu", "cuda"):
            raise InvalidOptionError(f"unknown device '{device}'; ONNX artifacts run on cpu or cuda")
        _check_onnx_fields(manifest)
        inputs = {entry["name"] for entry in manifest["interface"]["inputs"]}
        if device == "cuda":
            _check_runs_on_cuda(manifest)
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise InvalidOptionError(
                    f"--device cuda: this onnxruntime ({ort.__version__}) has no CUDAExecutionProvider; {_GPU_HINT}"
                )
        self.manifest = manifest
        self._device = device
        self._max_cache_len = manifest["max_cache_len"]
        path = folder / manifest["program"]
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
        options = ort.SessionOptions()
        # Errors only: a ring's GroupQueryAttention also returns ring + new keys (W + T rows), which
        # nothing reads, and ONNX Runtime's shape inference, expecting W, warns on every call.
        options.log_severity_level = 3
        if threads is not None:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
        try:
            self._session = ort.InferenceSession(str(path), options, providers=providers)
        except Exception as e:  # onnxruntime raises its own exception types for unreadable models
            raise ArtifactError(f"ONNX Runtime cannot load {path}: {(str(e).strip().splitlines() or [type(e).__name__])[0]}")
        if device == "cuda" and self._session.get_providers()[0] != "CUDAExecutionProvider":
            # onnxruntime falls back to the CPU (with a warning) when CUDA or cuDNN cannot load.
            raise InvalidOptionError(f"--device cuda: ONNX Runtime could not start CUDA here; {_GPU_HINT}")
        _check_against_graph(self._session, manifest)  # before any buffer is sized from the manifest
        self._dtype = np.dtype(manifest["dtype"])
        self._layers = [_Layer(ort, spec, self._max_cache_len, self._dtype, device) for spec in manifest["layers"]]
        self._rings = [layer for layer in self._layers if layer.window is not None]
        self._window = min((layer.window for layer in self._rings), default=None)
        # Tokens per call: the interface's limit, at most --prefill-chunk and at most the window (as
        # many more rows as a ring buffer holds once its last window - 1 are moved up, see _call).
        self._chunk = max_tokens_per_call(manifest)
        self._ring_rows = 0  # rows of each ring buffer in use: the next call's ring_start
        # Host memory for the small inputs and the logits: ONNX Runtime copies them across itself.
        self._tokens = np.zeros((1, self._max_cache_len), dtype=np.int64)
        self._input_pos = np.zeros((1,), dtype=np.int64)
        self._ring_start = np.zeros((1,), dtype=np.int64)
        # The attention kernels' total lengths (input_pos + T, ring_start + T), in host memory; a graph
        # of format version 3 or 4 computes them itself (see exporter/onnx/attention.py's
        # TOTAL_LENGTH_INPUTS).
        self._totals = {name: np.zeros((), dtype=np.int32) for name in ("total_length", "ring_total_length") if name in inputs}
        self._logits = np.zeros((1, manifest["vocab_size"]), dtype=self._dtype)
        self._binding = self._session.io_binding()
        self._binding.bind_output("logits", "cpu", 0, self._dtype, list(self._logits.shape), self._logits.ctypes.data)
        for layer in self._layers:  # every past is a whole buffer and its present the same: bound once
            for kv, buf in layer.buffers.items():
                self._bind_input(f"past_{kv}_{layer.index}", layer.shape, buf.ptr)
                self._bind_output(f"present_{kv}_{layer.index}", layer.shape, buf.ptr)
        self._next_start = 0

    def _bind_input(self, name: str, shape: list[int], ptr: int) -> None:
        self._binding.bind_input(name, self._device, 0, self._dtype, shape, ptr)

    def _bind_output(self, name: str, shape: list[int], ptr: int) -> None:
        self._binding.bind_output(name, self._device, 0, self._dtype, shape, ptr)

    def forward(self, tokens: list[int], start: int) -> np.ndarray:
        n = len(tokens)
        end = start + n
        if n == 0:
            raise InvalidOptionError("forward needs at least one token")
        if end > self._max_cache_len:
            raise PromptTooLongError(
                f"positions {start}..{end - 1} do not fit in the artifact's max_cache_len {self._max_cache_len}"
            )
        if start not in (0, self._next_start):
            raise InvalidOptionError(
                f"calls must be contiguous: this one starts at {start}, the sequence is at {self._next_start} "
                "(start at 0 for a new sequence)"
            )
        for first in range(0, n, self._chunk):
            self._call(tokens[first : first + self._chunk], start + first)
        self._next_start = end
        return self._logits[0].astype(np.float32)  # a copy: the next call overwrites the bound logits

    def _call(self, tokens: list[int], start: int) -> None:
        n = len(tokens)
        self._tokens[0, :n] = tokens
        self._input_pos[0] = start
        binding = self._binding
        # Host inputs are rebound every call: ONNX Runtime may copy them to the device when bound.
        binding.bind_input("tokens", "cpu", 0, np.int64, [1, n], self._tokens.ctypes.data)
        binding.bind_input("input_pos", "cpu", 0, np.int64, [1], self._input_pos.ctypes.data)
        if "total_length" in self._totals:
            self._bind_total("total_length", start + n)
        if self._rings:
            if start == 0:
                self._ring_rows = 0
            elif self._ring_rows + n > 2 * self._window:
                keep = self._window - 1  # the rows the call's first token still sees
                for layer in self._rings:
                    for buf in layer.buffers.values():
                        buf.move_rows(self._ring_rows - keep, keep)
                self._ring_rows = keep
            self._ring_start[0] = self._ring_rows
            binding.bind_input("ring_start", "cpu", 0, np.int64, [1], self._ring_start.ctypes.data)
            if "ring_total_length" in self._totals:
                self._bind_total("ring_total_length", self._ring_rows + n)
        self._session.run_with_iobinding(binding)
        self._ring_rows += n

    def _bind_total(self, name: str, value: int) -> None:
        total = self._totals[name]
        total[()] = value
        self._binding.bind_input(name, "cpu", 0, np.int32, [], total.ctypes.data)

    def reset(self) -> None:
        # Nothing to clear: a call at position 0 starts a new sequence (attention ignores older contents).
        self._next_start = 0


def load(folder: Path, manifest: dict, device: str) -> OnnxProgram:
    return OnnxProgram(Path(folder), manifest, device)
