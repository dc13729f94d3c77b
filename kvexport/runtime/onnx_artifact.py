"""What both ONNX runners (kvexport's, onnxruntime-genai's) check, beyond what ``read_manifest``
does: an artifact's ``genai_config.json`` against its ``kvexport.json`` (the graph leaves each cache
buffer's rows to the runtime, so what sizes them is checked against the config written with the
graph, which onnxruntime-genai sizes them from), what the GPU takes, and each call."""

from __future__ import annotations

import json
from pathlib import Path

from ..artifact.manifest import Interface, Manifest, buffer_layers, program_mismatch, read_listed_file
from ..errors import ArtifactError, InvalidOptionError


GPU_HINT = "install onnxruntime-gpu (pip install 'kvexport[gpu]') on a machine with an NVIDIA GPU, or use --device cpu"


def check_runs_on_cuda(manifest: Manifest) -> None:
    """What onnxruntime-gpu 1.31 gets wrong on CUDA (docs/onnx.md), refused before it runs."""
    if manifest.dtype not in ("float16", "bfloat16"):
        # Its CUDA GroupQueryAttention takes float16 and bfloat16 only: a float32 graph's
        # attention runs on the CPU provider, with copies across, and every step after the first
        # reads a wrong cache.
        raise InvalidOptionError(
            f"--device cuda runs float16 and bfloat16 ONNX artifacts; this one is {manifest.dtype}: "
            "export it with --dtype float16 (or bfloat16) for the GPU, or run it with --device cpu"
        )


def check_runs_on(manifest: Manifest, device: str) -> None:
    """Refuse, before a session is made, a device the artifact's dtype cannot run on."""
    if device == "cuda":
        check_runs_on_cuda(manifest)
    elif manifest.dtype == "bfloat16":
        raise InvalidOptionError(
            "a bfloat16 ONNX artifact runs on the GPU only (ONNX Runtime's CPU provider has no bfloat16 MatMul): "
            "run it with --device cuda, or export --dtype float32 or float16 for the CPU"
        )


# A verifying graph's input with a default (exporter/onnx/target.py), which genai does not bind.
LOGITS_INDICES = "logits_indices"


def check_against_genai_config(folder: Path, manifest: Manifest) -> None:
    """Refuse, in one line, a config that is not onnxruntime-genai's, or one that disagrees with the
    manifest in any field the manifest also says (the graph's rotary tables have ``context_length``
    rows; genai sizes the logits by ``vocab_size``, binds the graph by the names, stops at the EOS
    ids): the exporter wrote both from one spec, so a difference is an edit (sums recomputed)."""
    name = manifest.genai_config
    try:
        config = json.loads(read_listed_file(folder, manifest, name))
        model, decoder = config["model"], config["model"]["decoder"]
        sliding = decoder.get("sliding_window") or {}
        # genai sizes a buffer per layer that holds one; the first's shape is the default, and the
        # graph's inputs give each its own (checked against the manifest by kvexport's runner).
        layers = buffer_layers(manifest.layers)
        eos = list(manifest.eos_token_ids) or [-1]  # -1: no end-of-sequence token
        bos = manifest.bos_token_id if manifest.bos_token_id is not None else eos[0]
        interface = manifest.interface or Interface()
        said = {kind: [name for name in interface.names(kind) if name != LOGITS_INDICES] for kind in ("inputs", "outputs")}
        inputs, outputs = decoder["inputs"], decoder["outputs"]
        names = {  # the names genai binds: one past and present key and value per buffer layer
            "inputs": [inputs["input_ids"], inputs["attention_mask"],
                       *(_numbered(inputs[f"past_{kv}_names"], n) for n in range(len(layers)) for kv in ("key", "value"))],
            "outputs": [outputs["logits"],
                        *(_numbered(outputs[f"present_{kv}_names"], n) for n in range(len(layers)) for kv in ("key", "value"))],
        }  # fmt: skip
        facts = [
            ("max_cache_len", manifest.max_cache_len, model["context_length"], "context_length"),
            ("max_cache_len", manifest.max_cache_len, config["search"]["max_length"], "search.max_length"),
            ("vocab_size", manifest.vocab_size, model["vocab_size"], "vocab_size"),
            ("eos_token_ids", eos, model["eos_token_id"] if isinstance(model["eos_token_id"], list) else [model["eos_token_id"]],
             "eos_token_id"),
            ("bos_token_id", bos, model["bos_token_id"], "bos_token_id"),
            ("its padding token (its first EOS)", eos[0], model["pad_token_id"], "pad_token_id"),
            ("program", manifest.program, decoder["filename"], "filename"),
            *((f"the graph's {kind} include", ", ".join(sorted(set(said[kind]) - set(names[kind]))) or "no other",
               ", ".join(sorted(set(names[kind]) - set(said[kind]))) or "no other", f"decoder.{kind}")
              for kind in ("inputs", "outputs") if said[kind] and set(said[kind]) != set(names[kind])),
            ("layers with a cache", len(layers), decoder["num_hidden_layers"], "num_hidden_layers"),
            ("KV heads", layers[0].kv_heads, decoder["num_key_value_heads"], "num_key_value_heads"),
            ("head_dim", layers[0].head_dim, decoder["head_size"], "head_size"),
            ("the sliding layers", [n for n, layer in enumerate(layers) if layer.cache == "ring"],
             sliding.get("layers", []), "sliding_window.layers"),
            ("windows", sorted({layer.window for layer in layers if layer.cache == "ring"}),
             [sliding["window_size"]] if sliding else [], "sliding_window.window_size"),
            ("a cache that is both past and present", True, config["search"]["past_present_share_buffer"],
             "search.past_present_share_buffer"),
        ]
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:  # not JSON, or not genai's layout
        raise ArtifactError(f"{folder / name} is not an onnxruntime-genai config ({type(e).__name__}); re-run kvexport export")
    for what, says, has, field in facts:
        if json.dumps(says) != json.dumps(has):  # of one JSON type too: genai reads 1.0 or true as no count
            raise program_mismatch(what, says, f"{_shown(has)} ({name}'s {field})")


def _numbered(template, n: int) -> str:
    """genai's name of buffer ``n`` from its template (``past_key_values.%d.key``)."""
    if not isinstance(template, str):
        raise TypeError(f"a name template is {type(template).__name__}")
    return template % n


def _shown(value) -> str:
    """A config's value in a one-line message: as it is, or as JSON where it holds a line break or
    another character that is not printable; cut short where long."""
    text = str(value) if str(value).isprintable() else json.dumps(value)
    return text if len(text) <= 200 else text[:200] + "…"
