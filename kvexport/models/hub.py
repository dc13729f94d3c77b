"""A model by Hugging Face Hub id (``ORG/NAME``): taken from the local Hugging Face cache when it is
there, and otherwise downloaded, as ``hf download`` would, but only the files an export reads (see
``HUB_FILES``), or only the one ``.gguf`` file ``--gguf-file`` names. ``--offline`` or
``HF_HUB_OFFLINE=1`` forbids the network; ``HF_TOKEN`` (or ``hf auth login``) and ``HF_ENDPOINT``
work as in huggingface_hub. What goes wrong is said in one line (``_hub_error``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import InvalidOptionError, KvexportError, ModelNotFoundError, first_line
from .model_source import ModelSource

if TYPE_CHECKING:
    from ..progress import Progress


def looks_like_hub_id(name: str) -> bool:
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


def resolve_hub(
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
            f"model '{repo_id}' not found: it is no file or folder, and not a valid hub id ({first_line(e)})"
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
            problem = f"cannot be reached ({type(cause).__name__}: {first_line(cause)})"
        return ModelNotFoundError(
            f"'{repo_id}' is no local file or folder, and as a hub id it is not in the local Hugging Face cache, "
            f"and the Hub at {hub} {problem}; check the network (or HF_ENDPOINT), or export a model already "
            "in the cache with --offline"
        )
    if isinstance(e, HfHubHTTPError):
        return ModelNotFoundError(f"downloading '{repo_id}' from {hub} failed: {first_line(e)}")
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
