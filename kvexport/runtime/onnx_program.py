"""Runs ``model.onnx`` with ONNX Runtime, the KV cache held in buffers this runner owns.

numpy and onnxruntime only (no torch, no transformers), so an ONNX folder runs where neither is
installed. The graph's interface is in ``kvexport.json`` (``interface``) and is onnxruntime-genai's
(``genai_config.json``); in short, per layer a key and a value buffer, allocated once,
zero-filled, where the session runs (host memory on CPU, device memory on CUDA), and bound with
IOBinding to raw pointers into them, so nothing is copied in or out by Python. Every buffer is
bound once as both its layer's past and its present, and ONNX Runtime's GroupQueryAttention
writes the call's rows in place:

- a full-attention layer's buffer ``[1, kv_heads, max_cache_len, head_dim]``, of which the kernel
  reads rows ``0 .. start+T-1``, so a decode step costs the filled length;
- a sliding layer's buffer ``[1, kv_heads, window, head_dim]``, which the kernel keeps itself
  (``sliding_window_cache``: the newest positions in order from row 0, the oldest evicted);
- none for a layer that shares an earlier layer's cache (``shared``): the graph reads that one's;
- for a layer that does not attend (``conv``, ``recurrent``), each state in two buffers, the past
  and the present, swapped after every call (the graph reads a past after it begins writing the
  present, so the two cannot share memory).

The call's start is the width of ``attention_mask`` (ones) less its tokens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..artifact.manifest import MANIFEST, Layer, Manifest, buffer_layers, program_mismatch, state_layers
from ..errors import ArtifactError, InvalidOptionError
from .cpu import runtime_threads
from .generation import check_call, check_rows_by_position, check_verification
from .onnx_artifact import GPU_HINT, LOGITS_INDICES, check_against_genai_config, check_runs_on

# ONNX Runtime's element types of the manifest's dtypes.
_ORT_TYPES = {"float32": "tensor(float)", "float16": "tensor(float16)", "bfloat16": "tensor(bfloat16)"}


def _check_onnx_fields(manifest: Manifest) -> None:
    """What an ONNX artifact's manifest has besides the fields every artifact has (``read_manifest``
    checked their types where present): this runner names and sizes the buffers from them."""
    lacks = [key for key in ("interface", "external_data") if getattr(manifest, key) is None]
    if manifest.genai_config is None and manifest.genai_unsupported is None:
        lacks.append("genai_config")
    lacks += [f"interface.{key}" for key in ("inputs", "outputs") if not lacks and getattr(manifest.interface, key) is None]
    lacks += [
        f"layers[{i}].{field}"
        for i, layer in enumerate(manifest.layers)
        for field in _LAYER_FIELDS.get(layer.cache, ("index", "kv_heads", "head_dim"))
        if getattr(layer, field) is None
    ]
    if lacks:
        raise ArtifactError(f"{MANIFEST} lacks {lacks[0]}, which an ONNX artifact has; the manifest was edited or damaged, re-export")


# What this runner sizes a state layer's buffers from (see _state_shapes).
_LAYER_FIELDS = {"conv": ("index", "channels", "slots"), "recurrent": ("index", "channels", "slots", "state"), "none": ("index",)}


def _state_shapes(layer: Layer) -> list[tuple[str, list[int], str]]:
    """``(name, shape, dtype)`` of each state a layer that does not attend passes through the graph
    (exporter/onnx/target.py's PAST_STATE): its convolution's, then a recurrent state (float32)."""
    shapes = [("conv", [1, layer.channels, layer.slots], None)]
    if layer.cache == "recurrent":
        shapes.append(("recurrent", [1, *layer.state], "float32"))
    return shapes


def _check_against_graph(session, manifest: Manifest) -> None:
    """Refuse a manifest that does not describe the graph: the buffers and logits this runner sizes
    from it would not fit the graph's inputs (ONNX Runtime fails mid-generation), or, worse, would."""
    # An input with a default (logits_indices) is an initializer a caller may override.
    graph = {t.name: t for t in (*session.get_inputs(), *session.get_overridable_initializers())}
    outputs = {t.name: t for t in session.get_outputs()}
    said = manifest.interface.names("inputs")
    if sorted(said) != sorted(graph):
        raise program_mismatch("the graph's inputs are", ", ".join(said), ", ".join(graph))
    layers = buffer_layers(manifest.layers)
    in_graph = sum(name.startswith("past_key_values.") and name.endswith(".key") for name in graph)
    if len(layers) != in_graph:
        holding = " that hold a cache" if len(layers) < len(manifest.layers) else ""
        raise program_mismatch("the model has", f"{len(layers)} layers{holding}", f"{in_graph}")
    if "logits" not in outputs:
        raise program_mismatch("the graph has", "an output logits", "none")
    expected_type = _ORT_TYPES[manifest.dtype]
    cache_dtype = manifest.kv_cache_dtype
    cache_type = _ORT_TYPES.get(cache_dtype, f"tensor({cache_dtype})")
    if outputs["logits"].type != expected_type:
        raise program_mismatch("its dtype is", manifest.dtype, f"logits of {outputs['logits'].type}")
    _check_shape("logits", [1, 1, manifest.vocab_size], outputs["logits"].shape, "vocab_size")
    for n, spec in enumerate(layers):
        shape = [1, spec.kv_heads, _rows(spec, manifest.max_cache_len), spec.head_dim]
        fields = f"layers[{spec.index}]'s kv_heads, head_dim and " + ("max_cache_len" if spec.cache == "static" else "window")
        for kv in ("key", "value"):
            name = _cache_name("past", kv, n)
            if name not in graph or _cache_name("present", kv, n) not in outputs:
                raise program_mismatch("the graph has", name, "no such input")
            if graph[name].type != cache_type:
                raise program_mismatch("its KV cache's dtype is", cache_dtype, f"{name} of {graph[name].type}")
            _check_shape(name, shape, graph[name].shape, fields)
    states = [f"past_state.{layer.index}.{state}" for layer in state_layers(manifest.layers) for state, *_ in _state_shapes(layer)]
    if sorted(states) != sorted(name for name in graph if name.startswith("past_state.")):
        raise program_mismatch("the layers' states are", ", ".join(states) or "none",
                               ", ".join(name for name in graph if name.startswith("past_state.")) or "none")
    for layer in state_layers(manifest.layers):
        for state, shape, dtype in _state_shapes(layer):
            name = f"past_state.{layer.index}.{state}"
            if name not in graph or f"present_state.{layer.index}.{state}" not in outputs:
                raise program_mismatch("the graph has", name, "no such input")
            if graph[name].type != _ORT_TYPES[dtype or manifest.dtype]:
                raise program_mismatch(f"{name}'s dtype is", dtype or manifest.dtype, graph[name].type)
            _check_shape(name, shape, graph[name].shape, f"layers[{layer.index}]'s channels, slots and state")


def _cache_name(kind: str, kv: str, index) -> str:
    """onnxruntime-genai's names, as the exporter writes them (exporter/onnx/target.py's PAST,
    PRESENT): ``index`` counts the layers that hold a cache (``buffer_layers``)."""
    return f"past_key_values.{index}.{kv}" if kind == "past" else f"present.{index}.{kv}"


def _rows(spec: Layer, max_cache_len: int) -> int:
    """A layer's buffer rows in this runner: the cache's length, or a sliding layer's window."""
    return max_cache_len if spec.cache == "static" else spec.window


def _check_shape(name: str, said: list[int], has: list, fields: str) -> None:
    # A symbolic dimension (a name, or None) takes any size.
    if len(said) != len(has) or any(isinstance(h, int) and h != s for s, h in zip(said, has)):
        raise program_mismatch(f"(by its {fields}) {name} is", said, list(has))


# numpy has no bfloat16: such a buffer holds its bits as uint16 (zero bits are 0.0) and is bound
# as ONNX's BFLOAT16 element type, which ONNX Runtime's binding takes in place of a numpy dtype.
_BFLOAT16 = 16  # onnx.TensorProto.BFLOAT16


def _storage(dtype: str) -> np.dtype:
    return np.dtype(np.uint16) if dtype == "bfloat16" else np.dtype(dtype)


def _bound(dtype: str):
    return _BFLOAT16 if dtype == "bfloat16" else np.dtype(dtype)


def _as_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32)


class _Buffer:
    """One layer's key or value buffer, zero-filled, where the session runs."""

    def __init__(self, ort, shape: tuple[int, ...], dtype: str, device: str):
        zeros = np.zeros(shape, dtype=_storage(dtype))
        if device == "cpu":
            self.array = zeros
            self.ptr = zeros.ctypes.data
        else:
            self.value = ort.OrtValue.ortvalue_from_numpy(zeros, device, 0)
            self.ptr = self.value.data_ptr()


class _Layer:
    def __init__(self, ort, index: int, spec: Layer, max_cache_len: int, dtype: str, device: str):
        self.index = index  # in the graph's names: the n-th layer that holds a cache
        self.shape = [1, spec.kv_heads, _rows(spec, max_cache_len), spec.head_dim]  # GroupQueryAttention's layout
        self.buffers = {kv: _Buffer(ort, tuple(self.shape), dtype, device) for kv in ("key", "value")}
        self.ring = spec.cache == "ring"
        # A sliding buffer's first rows before each recent call, by the first position they hold:
        # what the call may have evicted, which a call that goes back (``rewind``) needs again.
        self.evicted: list[tuple[int, dict]] = []

    def keep_evictable(self, start: int, n: int) -> None:
        """Before a call of ``n`` tokens from ``start``: a copy of the first ``n`` rows, holding
        positions from ``start - min(start, rows)`` (the kernel keeps exactly the window's rows, the
        newest in order from row 0), the only ones the call can evict."""
        if self.ring:
            first = start - min(start, self.shape[2])
            self.evicted.append((first, {kv: buffer.array[:, :, :n].copy() for kv, buffer in self.buffers.items()}))

    def forget_before(self, position: int) -> None:
        """Drop the copies of positions before ``position``, which no rewind reaches any more."""
        self.evicted = [(first, kept) for first, kept in self.evicted if first + kept["key"].shape[2] > position]

    def rewind(self, end: int, start: int) -> None:
        """A sliding buffer as a call from ``start`` expects it, the sequence being at ``end``
        (``start < end``): the newest ``min(start, W)`` positions before ``start`` in order from row 0.
        Those from ``end - W`` on are in the buffer now; older ones were evicted by the calls since,
        and are in the rows kept before them (``keep_evictable``). A full layer needs nothing: the
        next call writes its rows from ``start`` on again, and reads no further."""
        if not self.ring:
            return
        rows = self.shape[2]
        wanted = np.arange(start - min(start, rows), start)  # what rows 0 .. min(start, W)-1 must hold
        oldest_held = end - min(end, rows)
        for kv, buffer in self.buffers.items():
            rebuilt = buffer.array[:, :, (wanted - oldest_held).clip(0, rows - 1)].copy()
            for first, kept in self.evicted:
                inside = (wanted < oldest_held) & (wanted >= first) & (wanted < first + kept[kv].shape[2])
                rebuilt[:, :, inside] = kept[kv][:, :, wanted[inside] - first]
            buffer.array[:, :, : len(wanted)] = rebuilt


class _State:
    """One state of a layer that does not attend: a past and a present buffer, swapped after each call."""

    def __init__(self, ort, layer: int, name: str, shape: list[int], dtype: str, device: str):
        self.past_name, self.present_name = f"past_state.{layer}.{name}", f"present_state.{layer}.{name}"
        self.shape, self.dtype = shape, dtype
        self.past, self.present = (_Buffer(ort, tuple(shape), dtype, device) for _ in range(2))

    def bind(self, binding, device: str) -> None:
        binding.bind_input(self.past_name, device, 0, _bound(self.dtype), self.shape, self.past.ptr)
        binding.bind_output(self.present_name, device, 0, _bound(self.dtype), self.shape, self.present.ptr)

    def swap(self) -> None:
        self.past, self.present = self.present, self.past


class OnnxProgram:
    def __init__(self, folder: Path, manifest: Manifest, device: str, threads: int | None = None):
        """``threads``: ONNX Runtime's intra-op threads (default: ``KVEXPORT_THREADS``, else its own
        choice, one per physical core). The threads spin-wait between the parallel parts of a call
        and stop when it returns (``session.force_spinning_stop``): between calls the cores belong
        to whatever runs next, a drafter's calls or the program verifying them (docs/speculative.md)."""
        import onnxruntime as ort

        if device not in ("cpu", "cuda"):
            raise InvalidOptionError(f"unknown device '{device}'; ONNX artifacts run on cpu or cuda")
        _check_onnx_fields(manifest)
        check_runs_on(manifest, device)
        if device == "cuda":
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise InvalidOptionError(
                    f"--device cuda: this onnxruntime ({ort.__version__}) has no CUDAExecutionProvider; {GPU_HINT}"
                )
        self.manifest = manifest
        self._device = device
        self._max_cache_len = manifest.max_cache_len
        path = folder / manifest.program
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
        options = ort.SessionOptions()
        options.log_severity_level = 3  # errors only
        options.add_session_config_entry("session.force_spinning_stop", "1")
        threads = threads if threads is not None else runtime_threads()
        if threads is not None:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
        try:
            self._session = ort.InferenceSession(str(path), options, providers=providers)
        except Exception as e:  # onnxruntime raises its own exception types for unreadable models
            raise ArtifactError(f"ONNX Runtime cannot load {path}: {(str(e).strip().splitlines() or [type(e).__name__])[0]}")
        if device == "cuda" and self._session.get_providers()[0] != "CUDAExecutionProvider":
            # onnxruntime falls back to the CPU (with a warning) when CUDA or cuDNN cannot load.
            raise InvalidOptionError(f"--device cuda: ONNX Runtime could not start CUDA here; {GPU_HINT}")
        _check_against_graph(self._session, manifest)  # before any buffer is sized from the manifest
        if manifest.genai_config is not None:
            check_against_genai_config(folder, manifest)
        self._dtype = manifest.dtype
        self._cache_dtype = manifest.kv_cache_dtype
        self._layers = [
            _Layer(ort, n, spec, self._max_cache_len, self._cache_dtype, device)
            for n, spec in enumerate(buffer_layers(manifest.layers))
        ]
        # Tokens per call: the interface's limit (--prefill-chunk).
        self._chunk = manifest.max_tokens_per_call
        # Host memory for the small inputs and the logits: ONNX Runtime copies them across itself.
        self._tokens = np.zeros((1, self._max_cache_len), dtype=np.int64)
        self._mask = np.ones((1, self._max_cache_len), dtype=np.int64)  # a call binds its first P + T
        self._logits = np.zeros((1, 1, manifest.vocab_size), dtype=_storage(self._dtype))
        self._binding = self._session.io_binding()
        self._bind_logits()
        self._last_row = np.array([-1], dtype=np.int64)  # logits_indices' default, bound again after a verification
        for layer in self._layers:  # every past is a whole buffer and its present the same: bound once
            for kv, buf in layer.buffers.items():
                bound = _bound(self._cache_dtype)
                self._binding.bind_input(_cache_name("past", kv, layer.index), device, 0, bound, layer.shape, buf.ptr)
                self._binding.bind_output(_cache_name("present", kv, layer.index), device, 0, bound, layer.shape, buf.ptr)
        self._states = [
            _State(ort, layer.index, name, shape, dtype or manifest.dtype, device)
            for layer in state_layers(manifest.layers)
            for name, shape, dtype in _state_shapes(layer)
        ]
        self._next_start = 0
        # Speculative decoding: a verification returns the logits of each of its positions, and a
        # call may start up to ``Manifest.rewind`` positions before the sequence's end (``_start_at``).
        self.max_draft_tokens = manifest.max_draft_tokens
        self._rewind = manifest.rewind
        self._ring_rewind = manifest.max_draft_tokens  # how far back the copies of evicted ring rows reach
        if self.max_draft_tokens and device != "cpu":
            raise InvalidOptionError("--device cuda: artifacts that verify drafted tokens run on cpu in this version")

    def forward(self, tokens: list[int], start: int) -> np.ndarray:
        self._start_at(tokens, start)
        for first in range(0, len(tokens), self._chunk):
            self._call(tokens[first : first + self._chunk], start + first)
        self._next_start = start + len(tokens)
        return _as_float32(self._logits[0, 0], self._dtype)  # a copy: the next call overwrites the bound logits

    def verify(self, tokens: list[int], start: int) -> np.ndarray:
        """One call of ``tokens`` (the last chosen token, then drafted ones) from ``start``; the
        logits ``[T, vocab]`` (float32) of each of its positions: row i chooses the token after
        ``tokens[i]``."""
        check_verification(tokens, self.max_draft_tokens)
        self._start_at(tokens, start)
        n = len(tokens)
        rows = np.arange(n, dtype=np.int64)
        self._binding.bind_input(LOGITS_INDICES, "cpu", 0, np.int64, [n], rows.ctypes.data)
        # Left for ONNX Runtime to allocate: the graph declares the default's [1, 1, vocab] (for
        # onnxruntime-genai), and a bound buffer of another shape is refused.
        self._binding.bind_output("logits", "cpu")
        try:
            self._call(tokens, start)
            logits = self._binding.get_outputs()[0].numpy()
        finally:
            self._binding.bind_input(LOGITS_INDICES, "cpu", 0, np.int64, [1], self._last_row.ctypes.data)
            self._bind_logits()
        self._next_start = start + n
        return logits[0].astype(np.float32, copy=False)

    def _bind_logits(self) -> None:
        self._binding.bind_output("logits", "cpu", 0, _bound(self._dtype), list(self._logits.shape), self._logits.ctypes.data)

    def _start_at(self, tokens: list[int], start: int) -> None:
        """Check a call's start; where it is before the sequence's end (rejected drafted tokens),
        rebuild the sliding layers' buffers as they were at ``start``."""
        check_call(tokens, start, self._next_start, self._max_cache_len, self._rewind)
        if not self._ring_rewind:
            return
        for layer in self._layers:
            if 0 < start < self._next_start:
                layer.rewind(self._next_start, start)
            # A later call goes back _ring_rewind positions before this one's end at most, and reads a window before that.
            layer.forget_before(start + len(tokens) - self._ring_rewind - layer.shape[2] if start else self._max_cache_len)

    def draft_rewind(self, positions: int) -> bool:
        """As a drafter: let a call start up to ``positions`` before the sequence's end, exactly: the
        sliding buffers are rebuilt from copies of what the calls evict, kept that far back (host
        memory: ``positions`` rows a layer). True."""
        if positions > self._rewind:
            check_rows_by_position(self.manifest)
            if self._device != "cpu" and any(layer.ring for layer in self._layers):
                raise InvalidOptionError("--draft: a drafting artifact with sliding layers runs on cpu in this version")
            self._rewind = self._ring_rewind = positions
        return True

    def _call(self, tokens: list[int], start: int) -> None:
        n = len(tokens)
        if self._ring_rewind:
            for layer in self._layers:
                layer.keep_evictable(start, n)
        self._tokens[0, :n] = tokens
        # Host inputs are rebound every call: ONNX Runtime may copy them to the device when bound.
        self._binding.bind_input("input_ids", "cpu", 0, np.int64, [1, n], self._tokens.ctypes.data)
        self._binding.bind_input("attention_mask", "cpu", 0, np.int64, [1, start + n], self._mask.ctypes.data)
        for state in self._states:
            state.bind(self._binding, self._device)
        self._session.run_with_iobinding(self._binding)
        for state in self._states:
            state.swap()

    def reset(self) -> None:
        # Nothing to clear: a call at position 0 starts a new sequence (attention ignores older contents).
        self._next_start = 0


def load(folder: Path, manifest: Manifest, device: str) -> OnnxProgram:
    return OnnxProgram(Path(folder), manifest, device)
