"""A model whose large weights stay in the checkpoint until the artifact is written.

An export traces the model's operations, not its weights' values; a target that writes each
weight on its own (the ONNX target's external data, XNNPACK's serialized weights) can read each one
from the checkpoint when it writes it, and never hold the model in its export dtype: an 8B model's
float32 weights are 32 GB.
A target that quantizes the model before export (ExecuTorch's 8da4w) reads each weight as it
quantizes it (``fill``), so it never holds more than one weight unquantized.
While transformers loads, every ``Linear`` and ``Embedding`` weight that the checkpoint stores
under the parameter's own name and shape loads as a placeholder: memory allocated and never
written (the OS maps no page of it until one is), which tracing reads as shapes only. The
``DeferredWeights`` this returns says where each placeholder's values are in the checkpoint, and
reads them, converted as transformers would have (``tensor.to(dtype)``), one weight at a time.

A placeholder that transformers converts while loading (concatenating or splitting weights) would
not be read back as the parameter it became: such a load is refused in one line
(``check_loaded``) rather than exported with made-up values. No family the tests cover does it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import KvexportError

# Module kinds whose weights are deferred: the large matrices, nearly all of a model's bytes.
DEFERRED_KINDS = ("Linear", "Embedding")


@dataclass(frozen=True)
class CheckpointTensor:
    file: Path
    key: str
    shape: tuple[int, ...]


@dataclass
class DeferredWeights:
    """Placeholders by their memory's address, and where each one's values are."""

    dtype: object  # the torch dtype the model loads in
    by_address: dict[int, CheckpointTensor] = field(default_factory=dict)
    # Every placeholder, held so that no other tensor gets its address while this lives (a
    # placeholder is address space only: it costs no memory until written).
    placeholders: list = field(default_factory=list)

    def source_of(self, tensor) -> CheckpointTensor | None:
        """Where ``tensor``'s values are, if it is a placeholder (the whole of one)."""
        entry = self.by_address.get(tensor.data_ptr())
        if entry is None or tuple(tensor.shape) != entry.shape or tensor.storage_offset() != 0:
            return None
        return entry

    def read(self, entry: CheckpointTensor, keep_bfloat16: bool = False):
        """The weight's values in the model's dtype, read from the checkpoint now; ``keep_bfloat16``:
        as stored where the checkpoint stores bfloat16 (for a layer quantized next: the same values
        at half float32's bytes, as ``sources.load_model``'s ``compact`` loads them)."""
        import torch
        from safetensors import safe_open

        with safe_open(str(entry.file), framework="pt", device="cpu", backend="pread") as f:
            tensor = f.get_tensor(entry.key)
        return tensor if keep_bfloat16 and tensor.dtype == torch.bfloat16 else tensor.to(self.dtype)

    def fill(self, module) -> None:
        """``module``'s weight, if a placeholder, replaced by its values read now, bfloat16 kept
        (``read``): for a layer about to be quantized."""
        import torch

        entry = self.source_of(module.weight)
        if entry is not None:
            module.weight = torch.nn.Parameter(self.read(entry, keep_bfloat16=True), requires_grad=False)

    def fill_all(self, model) -> None:
        """Every placeholder still in ``model`` replaced by its values in the model's dtype, one
        parameter for the modules that shared one (a tied lm_head): the weights quantization left."""
        import torch

        filled: dict[int, torch.nn.Parameter] = {}
        for module in model.modules():
            weight = getattr(module, "weight", None)
            plain = type(weight) in (torch.Tensor, torch.nn.Parameter)  # not a quantized tensor
            entry = self.source_of(weight) if plain else None
            if entry is not None:
                address = weight.data_ptr()
                if address not in filled:
                    filled[address] = torch.nn.Parameter(self.read(entry), requires_grad=False)
                module.weight = filled[address]

    @contextlib.contextmanager
    def read_while_running(self, model):
        """While ``model`` runs eagerly (the half-precision probe): each placeholder weight read
        from the checkpoint just before its module runs and let go after it, so the run holds one
        weight read at a time. Between calls a weight is a meta tensor, so a forward that reads one
        other than through its module's call fails instead of reading a placeholder's unwritten memory."""
        import torch

        placeholders = {}  # module -> its placeholder weight
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if type(weight) in (torch.Tensor, torch.nn.Parameter) and self.source_of(weight) is not None:
                placeholders[module] = weight

        def stand_in(module) -> None:
            weight = placeholders[module]
            module.weight = torch.nn.Parameter(torch.empty_like(weight, device="meta"), requires_grad=False)

        def before(module, args) -> None:
            module.weight = torch.nn.Parameter(self.read(self.source_of(placeholders[module])), requires_grad=False)

        handles = []
        for module in placeholders:
            stand_in(module)
            handles += [module.register_forward_pre_hook(before), module.register_forward_hook(lambda m, a, o: stand_in(m))]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            for module, weight in placeholders.items():
                module.weight = weight

    def check_loaded(self, model) -> None:
        """Every placeholder must be a parameter of ``model`` as it was made: one that transformers
        converted while loading would be exported with values nobody wrote."""
        held = {p.data_ptr() for p in model.parameters() if self.source_of(p) is not None}
        lost = [entry.key for address, entry in self.by_address.items() if address not in held]
        if lost:
            raise KvexportError(
                f"loading converted the checkpoint's {lost[0]} (and {len(lost) - 1} more) into another weight, "
                "which an export that reads weights from the checkpoint as it writes them cannot follow; "
                "please report it (the model's family needs its weights loaded first)"
            )


def checkpoint_index(folder: Path) -> dict[str, Path]:
    """Each tensor's safetensors file in a model folder (read from the files' headers). A file whose
    header cannot be read defers nothing: transformers' load then meets it and says what is wrong
    with it in one line, as for a model loaded whole (``loading.load_folder``)."""
    from safetensors import SafetensorError, safe_open

    index = {}
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                index.update(dict.fromkeys(f.keys(), file))
        except (OSError, SafetensorError):
            continue
    return index


class _Placeholder:
    """Stands for a checkpoint tensor in the state dict transformers loads from: what transformers
    reads from it (``tensor[...]``, then ``.to(dtype)``) is memory of the model's dtype that nobody
    has written, recorded in ``weights``."""

    def __init__(self, entry: CheckpointTensor, original, weights: DeferredWeights):
        self.entry, self.original, self.weights = entry, original, weights

    def get_shape(self):
        return list(self.entry.shape)

    def get_dtype(self):
        return self.original.get_dtype()

    def __getitem__(self, index):
        import torch

        placeholder = torch.empty(self.entry.shape, dtype=self.weights.dtype)
        self.weights.by_address[placeholder.data_ptr()] = self.entry
        self.weights.placeholders.append(placeholder)
        return placeholder


@contextlib.contextmanager
def weights_deferred(folder: Path, dtype):
    """While transformers loads from ``folder`` in ``dtype``: the large weights it would read are
    placeholders (module docstring). Yields the ``DeferredWeights`` that reads them back."""
    import torch
    import transformers.modeling_utils as modeling_utils

    weights = DeferredWeights(dtype)
    files = checkpoint_index(folder)
    classes = tuple(getattr(torch.nn, kind) for kind in DEFERRED_KINDS)
    convert = modeling_utils.convert_and_load_state_dict_in_model

    def convert_deferred(model, state_dict, *args, **kwargs):
        for name, module in model.named_modules():
            key = f"{name}.weight"
            weight, stored = getattr(module, "weight", None), state_dict.get(key)
            if not isinstance(module, classes) or weight is None or key not in files or not hasattr(stored, "get_shape"):
                continue
            if tuple(stored.get_shape()) == tuple(weight.shape):
                state_dict[key] = _Placeholder(CheckpointTensor(files[key], key, tuple(weight.shape)), stored, weights)
        return convert(model, state_dict, *args, **kwargs)

    modeling_utils.convert_and_load_state_dict_in_model = convert_deferred
    try:
        yield weights
    finally:
        modeling_utils.convert_and_load_state_dict_in_model = convert
