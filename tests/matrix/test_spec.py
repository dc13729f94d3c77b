"""The matrix file: rows expand as written, shards split them exactly, mistakes get one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvexport.errors import InvalidOptionError
from kvexport.matrix.spec import load_matrix, parse_shard, shard_rows

from tests.helpers import assert_one_line_error, run_cli

TINY_MATRIX = Path(__file__).resolve().parents[2] / "matrices" / "tiny.toml"


def write(tmp_path, text: str):
    path = tmp_path / "m.toml"
    path.write_text(text)
    return path


def test_tables_expand_to_the_product_with_defaults(tmp_path):
    matrix = load_matrix(write(tmp_path, """
[defaults]
target = ["executorch", "onnx"]
max_cache_len = 64
[[row]]
model = ["tiny-llama", "tiny-qwen3"]
[[row]]
model = "tiny-gemma3"
target = "executorch"
max_cache_len = [32, 48]
timeout_s = 60
"""))
    got = [(r.index, r.model, r.target, r.dtype, r.max_cache_len, r.timeout_s) for r in matrix.rows]
    assert got == [
        (0, "tiny-llama", "executorch", "float32", 64, 1800),
        (1, "tiny-qwen3", "executorch", "float32", 64, 1800),
        (2, "tiny-llama", "onnx", "float32", 64, 1800),
        (3, "tiny-qwen3", "onnx", "float32", 64, 1800),
        (4, "tiny-gemma3", "executorch", "float32", 32, 60),
        (5, "tiny-gemma3", "executorch", "float32", 48, 60),
    ]
    assert len({r.id for r in matrix.rows}) == 6


def test_a_quantized_row_is_a_row_of_its_own(tmp_path):
    """The same model and target, float and quantized: two rows, two ids, the scheme passed on."""
    matrix = load_matrix(write(tmp_path, """
[defaults]
model = "tiny-gemma3"
target = "onnx"
[[row]]
[[row]]
quantize = "int4"
[[row]]
target = "executorch"
quantize = "8da4w"
quantize_embedding = "int8"
"""))
    got = [(r.target, r.quantize, r.quantize_embedding) for r in matrix.rows]
    assert got == [("onnx", None, None), ("onnx", "int4", None), ("executorch", "8da4w", "int8")]
    assert [r.id.split("-", 1)[1] for r in matrix.rows] == [
        "tiny-gemma3-onnx-float32-default", "tiny-gemma3-onnx-float32-default-int4",
        "tiny-gemma3-executorch-float32-default-8da4w-embint8",
    ]


def test_a_row_sets_the_lm_head_scheme_grid_and_prefill_chunk(tmp_path):
    """Rows that differ only in ``quantize_lm_head``, ``quantize_grid`` or ``prefill_chunk`` are rows
    of their own."""
    matrix = load_matrix(write(tmp_path, """
[defaults]
model = "tiny-gemma3"
quantize = "8da4w"
[[row]]
[[row]]
quantize_lm_head = "int4"
[[row]]
prefill_chunk = 16
[[row]]
quantize_grid = "symmetric"
"""))
    assert [(r.quantize_lm_head, r.prefill_chunk, r.quantize_grid) for r in matrix.rows] == [
        (None, None, None), ("int4", None, None), (None, 16, None), (None, None, "symmetric")]
    assert [r.id.split("-", 1)[1] for r in matrix.rows] == [
        "tiny-gemma3-executorch-float32-default-8da4w", "tiny-gemma3-executorch-float32-default-8da4w-headint4",
        "tiny-gemma3-executorch-float32-default-8da4w-chunk16", "tiny-gemma3-executorch-float32-default-8da4w-gridsymmetric",
    ]


def test_a_model_built_from_a_config_in_the_file(tmp_path):
    matrix = load_matrix(write(tmp_path, """
[[row]]
model = "tiny-olmo2"
[models.tiny-olmo2]
model_type = "olmo2"
head_dim = 16
"""))
    (row,) = matrix.rows
    assert row.tiny_config == {"model_type": "olmo2", "overrides": {"head_dim": 16}}
    assert row.max_cache_len is None  # export's default


def test_a_model_at_a_published_shape_and_a_row_without_a_check(tmp_path):
    matrix = load_matrix(write(tmp_path, """
[[row]]
model = "llama-small"
target = "onnx"
check = false
[models.llama-small]
shape = "llama3.2-1b"
num_hidden_layers = 2
"""))
    (row,) = matrix.rows
    assert row.shape_config == {"shape": "llama3.2-1b", "overrides": {"num_hidden_layers": 2}}
    assert row.tiny_config is None and row.check is False
    assert load_matrix(TINY_MATRIX).rows[0].check is True  # the default


@pytest.mark.parametrize("path", sorted(TINY_MATRIX.parent.glob("*.toml")), ids=lambda p: p.name)
def test_every_matrix_file_the_repository_ships_loads(path):
    """Its models resolve, its options are export's, its [models.NAME] tables build configs."""
    assert load_matrix(path).rows


@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_shards_cover_every_row_exactly_once(count):
    matrix = load_matrix(TINY_MATRIX)
    shards = [shard_rows(matrix.rows, i, count) for i in range(1, count + 1)]
    indices = sorted(r.index for shard in shards for r in shard)
    assert indices == list(range(len(matrix.rows)))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    if count == 2:  # round robin with models varying fastest: each shard gets both targets
        assert all({r.target for r in shard} == {"executorch", "onnx"} for shard in shards)


@pytest.mark.parametrize(
    "text, phrase",
    [
        ("[[row]\nmodel = 'x'", "not valid TOML"),
        ("[defaults]\ntarget = 'executorch'", "no [[row]] tables"),
        ("[row]\nmodel = 'tiny-llama'", "[[row]] tables"),
        ("[[row]]\nmodel = 'tiny-llama'\nmax_len = 3", "unknown key in [[row]] #1 'max_len'"),
        ("[[row]]\ntarget = 'executorch'", "[[row]] #1 has no 'model'"),
        ("[[row]]\nmodel = 'no-such-model'", "[[row]] #1: model 'no-such-model' not found"),
        ("[[row]]\nmodel = 'tiny-llama'\ntarget = 'tflite'", "unknown target 'tflite'"),
        ("[[row]]\nmodel = 'tiny-llama'\ndtype = 'int3'", "unknown dtype 'int3'"),
        ("[[row]]\nmodel = 'tiny-llama'\nmax_cache_len = 0", "max_cache_len must be a positive integer"),
        ("[[row]]\nmodel = ['tiny-llama', 'tiny-llama']", "repeats row 0"),
        ("[[row]]\nmodel = 'x'\n[models.x]\nhead_dim = 4", "[models.x] needs model_type"),
        ("[[row]]\nmodel = 'x'\n[models.x]\nmodel_type = 'nope'", "no model type 'nope'"),
        ("[[row]]\nmodel = 'x'\n[models.x]\nshape = 'llama9'", "[models.x]: unknown shape 'llama9'; choose one of: gemma3-1b"),
        ("[[row]]\nmodel = 'x'\n[models.x]\nshape = 'gemma3-1b'\nmodel_type = 'gemma3'", "model_type (a tiny model) or shape"),
        ("[[row]]\nmodel = 'tiny-llama'\ncheck = 'no'", "'check' must be true or false, got 'no'"),
        ("[[row]]\nmodel = 'tiny-llama'\n[models.tiny-llama]\nmodel_type = 'llama'", "already a built-in model name"),
        ("colour = 1\n[[row]]\nmodel = 'tiny-llama'", "unknown top-level key 'colour'"),
        ("[[row]]\nmodel = 'tiny-llama'\ntarget = ['onnx', 'executorch']\nquantize = 'int4'",
         "[[row]] #1 (executorch): --quantize int4 is for --target onnx"),
        ("[[row]]\nmodel = 'tiny-llama'\ntarget = 'onnx'\nquantize = ['int4']", "'quantize' must be one string"),
        ("[[row]]\nmodel = 'tiny-llama'\ntarget = 'onnx'\nquantize = 'int4'\ndtype = 'float16'", "--quantize takes --dtype float32"),
        ("[[row]]\nmodel = 'tiny-llama'\nquantize_lm_head = 'int4'", "--quantize-lm-head goes with --quantize 8da4w"),
        ("[[row]]\nmodel = 'tiny-llama'\ntarget = 'onnx'\nquantize_grid = 'symmetric'", "--quantize-grid goes with --quantize int4"),
        ("[[row]]\nmodel = 'tiny-llama'\nprefill_chunk = 0", "'prefill_chunk' must be a positive integer"),
        ("[[row]]\nmodel = 'tiny-llama'\ntarget = ['executorch', 'onnx']\nkv_cache = 'int4'",
         "[[row]] #1 (executorch): unknown --kv-cache 'int4'"),
    ],
)
def test_mistakes_in_the_file_get_one_line(tmp_path, capsys, text, phrase):
    path = write(tmp_path, text)
    with pytest.raises(InvalidOptionError) as error:
        load_matrix(path)
    assert phrase in str(error.value) and str(path) in str(error.value)
    code, _, err = run_cli(capsys, "matrix", path)
    assert_one_line_error(code, err, phrase)


@pytest.mark.parametrize(
    ("text", "phrase"),
    [
        ("device = 'gpu'", "[[row]] #1: device must be one of cpu, cuda, got 'gpu'"),
        ("device = 'cuda'", "[[row]] #1 (executorch): device 'cuda' is for ONNX rows"),
        ("cpus = 0", "'cpus' must be a positive integer"),
        ("memory_gb = -1", "'memory_gb' must be a positive number"),
        ("resources = {arm64 = 'yes'}", "'resources' must be a table of Ray resource names"),
    ],
    ids=["device", "cuda-on-executorch", "cpus", "memory", "resources"],
)
def test_a_row_s_placement_mistakes_get_one_line(tmp_path, capsys, text, phrase):
    path = write(tmp_path, f"[[row]]\nmodel = 'tiny-llama'\n{text}\n")
    code, _, err = run_cli(capsys, "matrix", path)
    assert_one_line_error(code, err, phrase, str(path))


def test_a_cuda_row_is_a_row_of_its_own(tmp_path):
    rows = load_matrix(write(tmp_path, "[[row]]\nmodel = 'tiny-llama'\ntarget = 'onnx'\n"
                                       "[[row]]\nmodel = 'tiny-llama'\ntarget = 'onnx'\ndevice = 'cuda'\ncpus = 2\n")).rows
    assert [(r.device, r.cpus) for r in rows] == [("cpu", 1), ("cuda", 2)]
    assert rows[1].id.endswith("-cuda") and rows[0].id != rows[1].id


@pytest.mark.parametrize("spec", ["0/2", "3/2", "1/0", "2", "a/b", "1/2/3", ""])
def test_bad_shard_specs_are_refused(spec):
    with pytest.raises(InvalidOptionError, match="--shard takes I/N"):
        parse_shard(spec)


def test_bad_shard_on_the_command_line_gets_one_line(capsys):
    code, _, err = run_cli(capsys, "matrix", TINY_MATRIX, "--shard", "4/3")
    assert_one_line_error(code, err, "--shard takes I/N", "'4/3'")


def test_missing_matrix_file_gets_one_line(tmp_path, capsys):
    code, _, err = run_cli(capsys, "matrix", tmp_path / "nope.toml")
    assert_one_line_error(code, err, "not found")


def test_usage_mistakes_get_usage_not_a_traceback(capsys):
    code, _, err = run_cli(capsys, "matrix")
    assert code == 2 and "Missing argument" in err and "Traceback" not in err
    code, _, err = run_cli(capsys, "matrix", TINY_MATRIX, "--shards", "1/2")
    assert code == 2 and "No such option: --shards" in err and "Traceback" not in err


def test_a_row_takes_every_quantization_option_export_takes():
    from kvexport.exporter.quantization import OPTIONS
    from kvexport.matrix.spec import QUANTIZATION

    assert QUANTIZATION == OPTIONS
