"""The matrix file (TOML): which rows to run, and how they split into shards.

```toml
[defaults]                      # optional: any row key, for each row that does not set it
target = ["executorch", "onnx"]
max_cache_len = 64

[[row]]                         # each [[row]] table expands to the product of its lists
model = ["tiny-llama", "tiny-gemma3"]
dtype = "float32"

[models.tiny-olmo2]             # optional: a tiny random model of any transformers family
model_type = "olmo2"            # other keys override kvexport's tiny defaults (see presets.py)

[models."llama3.2-1b-random"]   # optional: a published configuration's shapes, random weights
shape = "llama3.2-1b"           # models/real_shapes.py's SHAPES; other keys override its config
```

Row keys: ``model``, ``target``, ``dtype``, ``max_cache_len`` (one value or a list; a missing
``max_cache_len`` is export's default); ``quantize``, ``quantize_embedding``, ``quantize_lm_head``
and ``quantize_grid`` (one value each, as ``kvexport export`` takes them: ``quantize`` ``int4`` for
onnx, ``8da4w`` for executorch, with ``quantize_embedding`` (executorch), ``quantize_lm_head``
``int8`` / ``int4`` and ``quantize_grid`` ``source`` / ``symmetric``; the row's check then measures
top-1 agreement); ``kv_cache`` (one value,
export's ``--kv-cache``: ``int8``, executorch; checked by agreement too); ``sdpa_query`` (one
value, export's ``--sdpa-query``: ``grouped`` or ``per-head``, executorch; default ``auto``);
``int8_kv_sdpa`` (one value, export's ``--int8-kv-sdpa``: ``quantized`` or ``dequantized``, with
``kv_cache`` ``int8``, executorch; default ``auto``); ``decode_attention`` (one value, export's
``--decode-attention``: ``kvexport``, executorch; default ``custom-sdpa``);
``prefill_chunk`` (one value: export's ``--prefill-chunk``; default: export's); ``check`` (``false``:
export and run only, for a model whose eager reference the machine cannot hold); ``timeout_s`` (the
row's child process is killed after it); ``check_new_tokens`` (new tokens per check prompt;
default: check's own, past the sliding window); ``run_new_tokens`` (tokens of the short run that
measures decode speed); ``device`` (``cpu``, or ``cuda`` for an ONNX row: its check and run on
the GPU).

Where a row runs on a Ray cluster (``kvexport matrix --ray``), it asks for ``cpus`` (default 1),
``memory_gb`` (default: the export's memory plan), a GPU when its ``device`` is ``cuda``, and any
custom Ray ``resources`` (a table, e.g. ``resources = {arm64 = 1}``); a local run ignores these.

Rows are numbered in file order, each table expanding with ``model`` varying fastest, so that a
round-robin split (row ``i`` to shard ``i % N + 1``) spreads models and targets over the shards.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import tomllib

from ..errors import InvalidOptionError, KvexportError
from ..exporter.quantization import OPTIONS as QUANTIZATION

AXES = ("target", "dtype", "max_cache_len", "model")  # expansion order: the last varies fastest
_OPTIONS = {"timeout_s": 1800, "check_new_tokens": None, "run_new_tokens": 32, "prefill_chunk": None}
_DEFAULTS = {"target": "executorch", "dtype": "float32", "max_cache_len": None}
SCHEMES = (*QUANTIZATION, "kv_cache", "sdpa_query", "int8_kv_sdpa", "decode_attention")  # a row's one value each (TOML has no null), None where export's default
# Where a row runs: its device, and what it asks of a Ray cluster (``cluster.py``).
_PLACEMENT = {"device": "cpu", "cpus": 1, "memory_gb": None, "resources": None}
ROW_KEYS = (*AXES, *SCHEMES, *_OPTIONS, *_PLACEMENT, "check")


@dataclass(frozen=True)
class Row:
    index: int  # position in the whole matrix
    model: str
    target: str
    dtype: str
    max_cache_len: int | None
    timeout_s: int
    check_new_tokens: int | None
    run_new_tokens: int
    # For a [models.NAME] model: its model_type and config overrides, built in the row's process.
    tiny_config: dict | None = None
    # For a [models.NAME] model with a shape: the shape's name and config overrides (random weights).
    shape_config: dict | None = None
    check: bool = True  # False: export and run only, no check against eager
    quantize: str | None = None
    quantize_embedding: str | None = None
    quantize_lm_head: str | None = None
    quantize_grid: str | None = None
    kv_cache: str | None = None  # export's --kv-cache (None: float)
    sdpa_query: str | None = None  # export's --sdpa-query (None: auto)
    int8_kv_sdpa: str | None = None  # export's --int8-kv-sdpa (None: auto)
    decode_attention: str | None = None  # export's --decode-attention (None: custom-sdpa)
    prefill_chunk: int | None = None  # export's --prefill-chunk (None: its default)
    device: str = "cpu"  # where the row's check and run go
    cpus: int = 1  # what the row asks of a Ray cluster
    memory_gb: float | None = None  # None: its export's memory plan
    resources: dict | None = None  # custom Ray resources, e.g. {"arm64": 1}

    @property
    def id(self) -> str:
        """Unique within a matrix, and usable as a folder name."""
        model = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(self.model).name)
        schemes = "".join(f"-{q}" for q in (self.quantize, self.quantize_embedding and f"emb{self.quantize_embedding}",
                                             self.quantize_lm_head and f"head{self.quantize_lm_head}",
                                             self.quantize_grid and f"grid{self.quantize_grid}",
                                             self.kv_cache and f"kv{self.kv_cache}",
                                             self.sdpa_query and f"sdpa{self.sdpa_query}",
                                             self.int8_kv_sdpa and f"kvsdpa{self.int8_kv_sdpa}",
                                             self.decode_attention and f"decode{self.decode_attention}",
                                             self.prefill_chunk and f"chunk{self.prefill_chunk}",
                                             self.device != "cpu" and self.device) if q)
        return f"{self.index:03d}-{model}-{self.target}-{self.dtype}-{self.max_cache_len or 'default'}{schemes}"

    def export_options(self) -> dict:
        """The row's ``ExportOptions`` keywords besides the model, its output and ``force``."""
        schemes = {key: getattr(self, key) for key in SCHEMES if getattr(self, key) is not None}
        return {"target": self.target, "dtype": self.dtype, "max_cache_len": self.max_cache_len,
                "prefill_chunk": self.prefill_chunk, **schemes}

    def to_dict(self) -> dict:
        return {**asdict(self), "id": self.id}

    @classmethod
    def from_dict(cls, data: dict) -> Row:
        return cls(**{k: v for k, v in data.items() if k != "id"})


@dataclass(frozen=True)
class Matrix:
    path: Path
    sha256: str  # of the file: shard reports merge only when they come from the same matrix
    rows: list[Row]


def load_matrix(path: Path | str) -> Matrix:
    """Read and check a matrix file; every mistake is one line naming the file (and row)."""
    path = Path(path)
    if not path.is_file():
        raise InvalidOptionError(f"matrix file {path} not found")
    raw = path.read_bytes()
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise InvalidOptionError(f"{path} is not valid TOML: {e}")
    try:
        rows = _rows(data)
    except KvexportError as e:
        raise InvalidOptionError(f"{path}: {e}")
    return Matrix(path, hashlib.sha256(raw).hexdigest(), rows)


def _rows(data: dict) -> list[Row]:
    _known_keys(data, ("defaults", "row", "models"), "top-level key")
    defaults = data.get("defaults", {})
    if not isinstance(defaults, dict):
        raise InvalidOptionError("[defaults] must be a table")
    _known_keys(defaults, ROW_KEYS, "key in [defaults]")
    tiny, shaped = _built_models(data.get("models", {}))
    tables = data.get("row", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise InvalidOptionError("rows are [[row]] tables (an array of tables)")
    if not tables:
        raise InvalidOptionError("no [[row]] tables: the matrix has no rows")
    rows: list[Row] = []
    seen: dict[tuple, int] = {}
    for number, table in enumerate(tables, 1):
        where = f"[[row]] #{number}"
        _known_keys(table, ROW_KEYS, f"key in {where}")
        merged = {**_DEFAULTS, **_OPTIONS, **_PLACEMENT, **defaults, **table}
        if "model" not in merged:
            raise InvalidOptionError(f"{where} has no 'model'")
        axes = {axis: _values(merged[axis], axis, where) for axis in AXES}
        options = {key: _option(merged[key], key, where) for key in _OPTIONS}
        schemes = {key: _scheme(merged.get(key), key, where) for key in SCHEMES}
        placement = _placement({key: merged[key] for key in _PLACEMENT}, where)
        check = merged.get("check", True)
        if not isinstance(check, bool):
            raise InvalidOptionError(f"{where}: 'check' must be true or false, got {check!r}")
        for target, dtype, max_cache_len, model in itertools.product(*(axes[a] for a in AXES)):
            _check_row(model, target, dtype, schemes, {**tiny, **shaped}, where)
            if placement["device"] == "cuda" and target != "onnx":
                raise InvalidOptionError(f"{where} ({target}): device 'cuda' is for ONNX rows; ExecuTorch artifacts run on the CPU")
            key = (model, target, dtype, max_cache_len, *schemes.values(), options["prefill_chunk"], placement["device"])
            if key in seen:
                raise InvalidOptionError(f"{where} repeats row {seen[key]} ({', '.join(str(k) for k in key if k is not None)})")
            seen[key] = len(rows)
            rows.append(Row(len(rows), model, target, dtype, max_cache_len, tiny_config=tiny.get(model),
                            shape_config=shaped.get(model), check=check, **options, **schemes, **placement))
    return rows


def _known_keys(table: dict, allowed: tuple, what: str) -> None:
    for key in table:
        if key not in allowed:
            raise InvalidOptionError(f"unknown {what} '{key}'; expected one of: {', '.join(allowed)}")


def _values(value, axis: str, where: str) -> list:
    values = value if isinstance(value, list) else [value]
    if not values:
        raise InvalidOptionError(f"{where}: '{axis}' is an empty list")
    for v in values:
        if axis == "max_cache_len":
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise InvalidOptionError(f"{where}: max_cache_len must be a positive integer, got {v!r}")
        elif not isinstance(v, str) or not v:
            raise InvalidOptionError(f"{where}: '{axis}' must be a string or a list of strings, got {v!r}")
    return values


def _option(value, key: str, where: str):
    if value is None and _OPTIONS[key] is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidOptionError(f"{where}: '{key}' must be a positive integer, got {value!r}")
    return value


def _scheme(value, key: str, where: str) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise InvalidOptionError(f"{where}: '{key}' must be one string (a row's scheme), got {value!r}")
    return value


def _placement(values: dict, where: str) -> dict:
    """A row's device and what it asks of a Ray cluster, checked."""
    from ..runtime.options import DEVICES

    if values["device"] not in DEVICES:
        raise InvalidOptionError(f"{where}: device must be one of {', '.join(DEVICES)}, got {values['device']!r}")
    cpus = values["cpus"]
    if not isinstance(cpus, int) or isinstance(cpus, bool) or cpus < 1:
        raise InvalidOptionError(f"{where}: 'cpus' must be a positive integer, got {cpus!r}")
    memory = values["memory_gb"]
    if memory is not None and (not isinstance(memory, (int, float)) or isinstance(memory, bool) or memory <= 0):
        raise InvalidOptionError(f"{where}: 'memory_gb' must be a positive number, got {memory!r}")
    resources = values["resources"]
    if resources is not None and (
        not isinstance(resources, dict)
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in resources.values())
    ):
        raise InvalidOptionError(f"{where}: 'resources' must be a table of Ray resource names to positive amounts, "
                                 f"e.g. {{arm64 = 1}}; got {resources!r}")
    return values


def _check_row(model: str, target: str, dtype: str, schemes: dict, built: dict, where: str) -> None:
    from ..choices import Dtype, Target, choose
    from ..exporter.options import ExportOptions
    from ..models import sources

    try:
        choose(Target, target, "target")
        choose(Dtype, dtype, "dtype")
    except KvexportError as e:
        raise InvalidOptionError(f"{where}: {e}")
    try:  # the same one-line refusal `kvexport export` gives, per expanded row
        ExportOptions(model, target, dtype=dtype, **{k: v for k, v in schemes.items() if v is not None}).check()
    except KvexportError as e:
        raise InvalidOptionError(f"{where} ({target}): {e}")
    if model not in built:
        try:
            sources.resolve(model)
        except KvexportError as e:
            raise InvalidOptionError(f"{where}: {e}")


def _built_models(models) -> tuple[dict[str, dict], dict[str, dict]]:
    """``[models.NAME]`` tables, checked: the tiny ones (``model_type`` and config overrides, as
    transformers knows it) and the real-shape ones (``shape`` and config overrides)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from ..models import real_shapes, sources

    if not isinstance(models, dict):
        raise InvalidOptionError("[models] must be a table of [models.NAME] tables")
    tiny, shaped = {}, {}
    for name, table in models.items():
        if not isinstance(table, dict):
            raise InvalidOptionError(f"[models.{name}] must be a table")
        if name in sources.known_names():
            raise InvalidOptionError(f"[models.{name}]: '{name}' is already a built-in model name; choose another")
        if "shape" in table:
            if "model_type" in table:
                raise InvalidOptionError(f"[models.{name}] takes model_type (a tiny model) or shape (a real one), not both")
            overrides = {k: v for k, v in table.items() if k != "shape"}
            try:
                real_shapes.shape_config(table["shape"], overrides)
            except (KvexportError, TypeError, ValueError) as e:
                raise InvalidOptionError(f"[models.{name}]: {e}")
            shaped[name] = {"shape": table["shape"], "overrides": overrides}
            continue
        model_type = table.get("model_type")
        if not isinstance(model_type, str):
            raise InvalidOptionError(f"[models.{name}] needs model_type, a transformers model type such as \"olmo2\" "
                                     "(or shape, a published configuration such as \"llama3.2-1b\")")
        if model_type not in CONFIG_MAPPING_NAMES:
            raise InvalidOptionError(f"[models.{name}]: transformers has no model type '{model_type}'")
        tiny[name] = {"model_type": model_type, "overrides": {k: v for k, v in table.items() if k != "model_type"}}
    return tiny, shaped


def parse_shard(spec: str) -> tuple[int, int]:
    """``"I/N"`` -> ``(I, N)``, ``1 <= I <= N``."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", spec or "")
    if not match or not 1 <= int(match[1]) <= int(match[2]):
        raise InvalidOptionError(f"--shard takes I/N with 1 <= I <= N (e.g. 2/4), got '{spec}'")
    return int(match[1]), int(match[2])


def shard_rows(rows: list[Row], index: int, count: int) -> list[Row]:
    """Shard ``index`` of ``count``: rows ``index - 1``, ``index - 1 + count``, ... (round robin)."""
    return [row for row in rows if row.index % count == index - 1]
