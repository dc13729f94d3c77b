"""Runs ``model.onnx`` with ONNX Runtime, the KV cache held in buffers this runner owns.

numpy and onnxruntime only (no torch, no transformers), so an ONNX folder runs where neither is
installed. The graph's interface is in ``kvexport.json`` (``interface``); in short, per layer a key
and a value buffer, allocated once, zero-filled, where the session runs (host memory on CPU,
device memory on CUDA), and bound with IOBinding to raw pointers into them, so nothing is copied
in or out by Python:

- a static layer's buffer ``[1, kv_heads, max_cache_len, head_dim]`` is bound once as both its
  past and its present: ONNX Runtime's GroupQueryAttention then writes the call's rows in place
  and reads rows ``0 .. start+T-1`` only, so a decode step costs the filled length, whatever
  ``max_cache_len`` is;
- a ring ``[1, window, kv_heads, head_dim]`` is bound once as its past. A one-token call's new
  row goes straight to its slot ``start % window``: that slot's old row (position
  ``start - window``) is outside the window of the only query, so the mask gives it weight 0
  whether ONNX Runtime reads it before or after the write. A multi-token call's rows come back to
  host memory and the newest one per slot is written, as ``RingKVCache.update`` does (prefill and
  chunked prefill only).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import ArtifactError, InvalidOptionError, PromptTooLongError

_GPU_HINT = "install onnxruntime-gpu (pip install 'kvexport[gpu]') on a machine with an NVIDIA GPU, or use --device cpu"


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
        self.row_bytes = int(np.prod(shape[2:])) * dtype.itemsize  # a ring's slot (sequence-major)

    def row_ptr(self, row: int) -> int:
        return self.ptr + row * self.row_bytes

    def write_rows(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """``rows[0, j]`` into slot ``slots[j]`` (multi-token ring calls only)."""
        if self.device == "cpu":
            self.array[0, slots] = rows[0]
        else:  # no device-side scatter without a framework: round-trip the ring (W rows, prefill only)
            ring = self.value.numpy()
            ring[0, slots] = rows[0]
            self.value.update_inplace(ring)


class _Layer:
    def __init__(self, ort, spec: dict, max_cache_len: int, dtype: np.dtype, device: str):
        self.index = spec["index"]
        self.window = spec["window"] if spec["cache"] == "ring" else None
        self.row_shape = (spec["kv_heads"], spec["head_dim"])
        if self.window is None:  # head-major, GroupQueryAttention's layout
            self.shape = [1, spec["kv_heads"], max_cache_len, spec["head_dim"]]
        else:
            self.shape = [1, self.window, *self.row_shape]
        self.buffers = {kv: _Buffer(ort, tuple(self.shape), dtype, device) for kv in ("key", "value")}


class OnnxProgram:
    def __init__(self, folder: Path, manifest: dict, device: str, threads: int | None = None):
        """``threads``: ONNX Runtime's intra-op threads (default: its own choice, one per physical core)."""
        import onnxruntime as ort

        if device not in ("cpu", "cuda"):
            raise InvalidOptionError(f"unknown device '{device}'; ONNX artifacts run on cpu or cuda")
        if device == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
            raise InvalidOptionError(
                f"--device cuda: this onnxruntime ({ort.__version__}) has no CUDAExecutionProvider; {_GPU_HINT}"
            )
        self.manifest = manifest
        self._device = device
        self._dtype = np.dtype(manifest["dtype"])
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
            raise ArtifactError(f"ONNX Runtime cannot load {path}: {str(e).strip().splitlines()[0]}")
        if device == "cuda" and self._session.get_providers()[0] != "CUDAExecutionProvider":
            # onnxruntime falls back to the CPU (with a warning) when CUDA or cuDNN cannot load.
            raise InvalidOptionError(f"--device cuda: ONNX Runtime could not start CUDA here; {_GPU_HINT}")
        self._layers = [_Layer(ort, spec, self._max_cache_len, self._dtype, device) for spec in manifest["layers"]]
        # Host memory for the small inputs and the logits: ONNX Runtime copies them across itself.
        self._tokens = np.zeros((1, self._max_cache_len), dtype=np.int64)
        self._input_pos = np.zeros((1,), dtype=np.int64)
        self._logits = np.zeros((1, manifest["vocab_size"]), dtype=self._dtype)
        self._binding = self._session.io_binding()
        self._binding.bind_output("logits", "cpu", 0, self._dtype, list(self._logits.shape), self._logits.ctypes.data)
        for layer in self._layers:  # every past is a whole buffer: bound once
            for kv, buf in layer.buffers.items():
                self._bind_input(f"past_{kv}_{layer.index}", layer.shape, buf.ptr)
                if layer.window is None:  # present is the past, written in place
                    self._bind_output(f"present_{kv}_{layer.index}", layer.shape, buf.ptr)
        self._next_start = 0

    def _bind_input(self, name: str, shape: list[int], ptr: int) -> None:
        self._binding.bind_input(name, self._device, 0, self._dtype, shape, ptr)

    def _bind_output(self, name: str, shape: list[int], ptr: int, device: str | None = None) -> None:
        self._binding.bind_output(name, device or self._device, 0, self._dtype, shape, ptr)

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
        self._tokens[0, :n] = tokens
        self._input_pos[0] = start
        binding = self._binding
        # Host inputs are rebound every call: ONNX Runtime may copy them to the device when bound.
        binding.bind_input("tokens", "cpu", 0, np.int64, [1, n], self._tokens.ctypes.data)
        binding.bind_input("input_pos", "cpu", 0, np.int64, [1], self._input_pos.ctypes.data)
        staged = []  # (layer, kv, host rows) of multi-token ring calls, written after the run
        for layer in self._layers:
            if layer.window is None:
                continue
            for kv, buf in layer.buffers.items():
                present = f"present_{kv}_{layer.index}"
                if n == 1:
                    self._bind_output(present, [1, 1, *layer.row_shape], buf.row_ptr(start % layer.window))
                else:
                    rows = np.empty((1, n, *layer.row_shape), dtype=self._dtype)
                    self._bind_output(present, list(rows.shape), rows.ctypes.data, device="cpu")
                    staged.append((buf, layer.window, rows))
        self._session.run_with_iobinding(binding)
        for buf, window, rows in staged:
            keep = min(n, window)  # the newest token of each slot
            slots = np.arange(end - keep, end) % window
            buf.write_rows(slots, rows[:, n - keep:])
        self._next_start = end
        return self._logits[0].astype(np.float32)  # a copy: the next call overwrites the bound logits

    def reset(self) -> None:
        # Nothing to clear: a call at position 0 starts a new sequence (the masks ignore older contents).
        self._next_start = 0


def load(folder: Path, manifest: dict, device: str) -> OnnxProgram:
    return OnnxProgram(Path(folder), manifest, device)
