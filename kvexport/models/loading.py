"""A Hugging Face model folder loaded as an export needs it: the tokenizer, then the weights, with
transformers' loading report read and a partial load refused (a weight missing, one too many or one
of another shape), and, for ``compact``, the weights a quantization replaces kept in bfloat16 as the
checkpoint stores them.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from ..errors import InvalidModelError, ModelNotFoundError, UnsupportedModelError, first_line
from ..logs import transformers_progress_quiet
from .chat_templates import fallback_chat_template


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def load_folder(folder: Path, dtype: str, name: str):
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # The tokenizer first: it loads in a second, the weights may take minutes.
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(
            f"'{name}' has no usable tokenizer ({first_line(e).rstrip(': ')}); "
            "the folder needs the model's tokenizer files (tokenizer.json or tokenizer.model)"
        )
    try:
        model, report = with_loading_report(
            lambda **report: AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype(dtype), **report)
        )
    except ValueError as e:  # transformers says "Unrecognized configuration class ..." for non-causal-LM models
        raise UnsupportedModelError(f"'{name}' cannot be loaded as a causal LM: {first_line(e)}")
    except (OSError, RuntimeError, EOFError, SafetensorError) as e:  # missing, truncated or corrupt weight files
        raise ModelNotFoundError(
            f"cannot load the weights of '{name}' ({first_line(e)}); a weight file is missing, truncated or "
            "corrupt: fetch the model again"
        )
    refuse_a_partial_load(report, name)
    if tokenizer.chat_template is None:  # e.g. Gemma 3 270M's GGUF has no tokenizer.chat_template key
        tokenizer.chat_template = fallback_chat_template(model.config.get_text_config().model_type, tokenizer.get_vocab())
    return model.eval(), tokenizer


def with_loading_report(from_pretrained):
    """``from_pretrained(**options)``'s model and transformers' loading report (its missing,
    unexpected and mis-shaped keys, after the ones the model class ignores and tied weights), with
    no "Loading weights" bar and no report table on stderr: ``refuse_a_partial_load`` says it in
    one line. A mis-shaped weight is reported rather than raised, so that line can name it."""
    import logging

    from ..logs import verbose

    # A filter, not a level: transformers checks its tensor-parallel plan, and warns about it, when
    # this logger's level is set.
    report_logger = logging.getLogger("transformers.modeling_utils")

    def no_report(record: logging.LogRecord) -> bool:
        return verbose() or "LOAD REPORT" not in record.getMessage()

    report_logger.addFilter(no_report)
    try:
        with transformers_progress_quiet(), _weights_read_not_mapped():
            return from_pretrained(output_loading_info=True, ignore_mismatched_sizes=True)
    finally:
        report_logger.removeFilter(no_report)


# What ``load_model``'s ``compact`` may keep in bfloat16: the weights of these module kinds.
COMPACT_KINDS = {"linear": "Linear", "embedding": "Embedding"}


@contextlib.contextmanager
def weights_kept_in_bfloat16(kinds: tuple[str, ...]):
    """While transformers loads: the weights of the ``kinds`` of module (``COMPACT_KINDS``) that the
    checkpoint stores in bfloat16 are made bfloat16 in the model before any is read. transformers
    reads each weight in its parameter's dtype, so these are read as stored, with no float32 copy
    at any time (the same values: they are the checkpoint's); the others load in the model's
    dtype. transformers has no option for a dtype per module kind; this wraps its loading step."""
    import torch
    import transformers.modeling_utils as modeling_utils

    classes = tuple(getattr(torch.nn, COMPACT_KINDS[kind]) for kind in kinds)
    convert = modeling_utils.convert_and_load_state_dict_in_model

    def convert_compact(model, state_dict, *args, **kwargs):
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if isinstance(module, classes) and weight is not None and _stored_in_bfloat16(state_dict.get(f"{name}.weight")):
                module.weight = torch.nn.Parameter(torch.empty_like(weight, dtype=torch.bfloat16), requires_grad=False)
        return convert(model, state_dict, *args, **kwargs)

    modeling_utils.convert_and_load_state_dict_in_model = convert_compact
    try:
        yield
    finally:
        modeling_utils.convert_and_load_state_dict_in_model = convert


def _stored_in_bfloat16(tensor) -> bool:
    """A checkpoint's tensor: a safetensors slice (not yet read) or a tensor."""
    import torch

    if hasattr(tensor, "get_dtype"):
        return tensor.get_dtype() == "BF16"
    return isinstance(tensor, torch.Tensor) and tensor.dtype == torch.bfloat16


def widen_compact_weights(model) -> None:
    """The weights ``load_model``'s ``compact`` kept in bfloat16 and quantization left in float
    (a width no multiple of the group), back in float32."""
    import torch

    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and weight is not None and weight.dtype == torch.bfloat16:
            module.weight = torch.nn.Parameter(weight.detach().float(), requires_grad=False)


@contextlib.contextmanager
def _weights_read_not_mapped():
    """transformers memory-maps a safetensors checkpoint and converts each tensor into the model's
    dtype; the mapped pages it has read stay resident (and count in the process's peak) until the
    file is closed, after the last tensor. Loading a bfloat16 checkpoint in float32 then peaks at
    the checkpoint's bytes plus the model's. safetensors' ``pread`` backend (which transformers
    itself uses on Windows and MPS) reads each tensor into memory of its own as it is converted, and
    frees it after: the peak is the model's bytes and one tensor (docs/performance.md)."""
    import transformers.modeling_utils as modeling_utils
    from safetensors import safe_open

    def read_not_mapped(filename, framework, device="cpu", backend=None):
        return safe_open(filename, framework=framework, device=device, backend="pread")

    modeling_utils.safe_open = read_not_mapped
    try:
        yield
    finally:
        modeling_utils.safe_open = safe_open


def refuse_a_partial_load(report: dict, name: str) -> None:
    """Refuse a model whose checkpoint lacks a weight its config describes (transformers initialises
    it at random, and only warns), holds one the model has no place for, or holds one in another
    shape: naming the first such key, in the model's order."""
    missing, unexpected = _in_order(report["missing_keys"]), _in_order(report["unexpected_keys"])
    shapes = {key: (list(found), list(wanted)) for key, found, wanted in report["mismatched_keys"]}
    if missing:
        problem = f"its weights lack {_some(missing)}, which its config asks for (transformers would make them up at random)"
    elif unexpected:
        problem = f"its weights hold {_some(unexpected)}, for which its config has no place"
    elif shapes:
        keys = _in_order(shapes)
        found, wanted = shapes[keys[0]]
        others = f" ({len(keys) - 1} more weights too)" if len(keys) > 1 else ""
        problem = f"its weights hold {keys[0]} as {found}, where its config asks for {wanted}{others}"
    else:
        return
    raise InvalidModelError(
        f"'{name}': {problem}; its config and its weights disagree (a field such as num_hidden_layers missing or "
        "wrong, or weights of another model): fix the config or fetch the model again"
    )


def _in_order(keys) -> list[str]:
    """Weight names in the model's order: model.layers.2 before model.layers.10."""
    return sorted(keys, key=lambda key: [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in key.split(".")])


def _some(keys: list[str]) -> str:
    return keys[0] + (f" and {len(keys) - 1} more weights" if len(keys) > 1 else "")
