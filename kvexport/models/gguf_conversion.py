"""GGUF models are dequantized by transformers on load, which is slow, so the first load also saves
a plain HF folder under the kvexport cache (named by the file's content); later loads read that. A
GGUF that cannot be read, or whose weights and metadata disagree, is refused in one line.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

from ..artifact.staging import process_running
from ..errors import ModelNotFoundError, first_line
from ..outputs import check_writable
from .loading import refuse_a_partial_load, torch_dtype, with_loading_report
from .model_source import ModelSource


def default_cache_dir() -> Path:
    return Path(os.environ.get("KVEXPORT_CACHE", Path.home() / ".cache" / "kvexport"))


def check_conversion_cache(source: ModelSource, cache_dir: Path | None = None) -> None:
    """Refuse, before a GGUF is converted (a minute and more for a real model) rather than after, a
    kvexport cache where its converted folder cannot be written; nothing where it is there already."""
    if source.kind not in ("alias", "gguf"):
        return
    folder = converted_folder(source.path, cache_dir)
    if not (folder / "config.json").is_file():
        check_writable(folder.parent, "KVEXPORT_CACHE", kind="in",
                       fix="set KVEXPORT_CACHE to a folder you can write (a GGUF's conversion to float32 is kept there)")


def converted_folder(gguf: Path, cache_dir: Path | None) -> Path:
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


def plain_folder(source: ModelSource, cache_dir: Path | None) -> Path:
    """A float32 HF folder for a GGUF file, converted once and kept in the kvexport cache."""
    gguf = source.path
    folder = converted_folder(gguf, cache_dir)
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
    remove_abandoned_conversions(folder.parent)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f"{_TMP_PREFIX}{os.getpid()}@{socket.gethostname()}."))
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


# A conversion in progress: ``.tmp-PID@HOST.*``, renamed to its folder when complete.
_TMP_PREFIX = ".tmp-"


def remove_abandoned_conversions(cache: Path) -> None:
    """Remove the half-written conversions of this host's processes that are gone (killed: SIGKILL,
    out of memory), a model's float32 weights each. A running conversion's stays, and so does
    another host's (a cache on a shared disk), whose processes this one cannot see."""
    for tmp in cache.glob(f"{_TMP_PREFIX}*@{socket.gethostname()}.*"):
        pid = tmp.name.removeprefix(_TMP_PREFIX).partition("@")[0]
        if pid.isdigit() and not process_running(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _checked_gguf_model(source: ModelSource):
    """The GGUF's model in float32, refused (before a made-up weight would be saved as if read) where
    its weights and its metadata disagree. transformers' GGUF reader skips the tensors it has no
    name for, which include those of layers past the metadata's block_count: those are added."""
    from transformers import AutoModelForCausalLM

    gguf = source.path

    def from_gguf(**report):
        return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch_dtype("float32"), **report)

    model, report = _read_gguf(lambda: with_loading_report(from_gguf), source)
    beyond = _read_gguf(lambda: _tensors_past_the_blocks(gguf, model.config.get_text_config().num_hidden_layers), source)
    refuse_a_partial_load({**report, "unexpected_keys": [*report["unexpected_keys"], *beyond]}, source.label)
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
            f"cannot read '{source.label}' as a GGUF model ({first_line(e)}); the file is truncated or not GGUF: "
            "fetch it again"
        )


@functools.lru_cache(maxsize=4)
def gguf_config(source: ModelSource, size: int, mtime_ns: int):
    """A GGUF file's config, read once per process while its size and mtime stay (transformers parses
    the whole file's metadata for it: seconds)."""
    from transformers import AutoConfig

    return _read_gguf(lambda: AutoConfig.from_pretrained(source.path.parent, gguf_file=source.path.name), source)
