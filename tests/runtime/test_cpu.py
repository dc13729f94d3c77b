"""What the CPU offers the runtimes' kernels, read from /proc/cpuinfo."""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvexport.runtime.cpu as cpu
from kvexport.errors import InvalidOptionError


def reading(monkeypatch, tmp_path, text: str) -> None:
    """/proc/cpuinfo is ``text`` for the test, on Linux."""
    fake, real_path = tmp_path / "cpuinfo", Path
    fake.write_text(text)
    monkeypatch.setattr(cpu, "Path", lambda p: real_path(fake if p == "/proc/cpuinfo" else p))
    monkeypatch.setattr(cpu.platform, "system", lambda: "Linux")


def test_cpu_info_names_the_instruction_sets_that_pick_the_kernels(tmp_path, monkeypatch):
    reading(monkeypatch, tmp_path, "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 fma avx512f avx512_vnni\n")
    assert cpu.cpu_info() == ("AMD EPYC", ["avx2", "avx512f", "avx512_vnni"])
    reading(monkeypatch, tmp_path, "processor\t: 0\nFeatures\t: fp asimd asimddp i8mm\nCPU part\t: 0xd0c\n")  # ARM: no model name
    name, features = cpu.cpu_info()
    assert features == ["asimddp", "i8mm"] and name


def test_xnnpack_sums_float16_in_float16_where_the_cpu_has_float16_arithmetic(tmp_path, monkeypatch):
    reading(monkeypatch, tmp_path, "model name\t: Intel Xeon\nflags\t\t: avx2 f16c avx512f avx512_bf16 avx512_fp16 amx_int8\n")
    assert cpu.xnnpack_sums_float16_in_float16()
    reading(monkeypatch, tmp_path, "model name\t: AMD EPYC\nflags\t\t: avx2 f16c avx512f avx512_bf16\n")  # F16C converts only
    assert not cpu.xnnpack_sums_float16_in_float16()
    reading(monkeypatch, tmp_path, "Features\t: fp asimd fphp asimdhp asimddp\n")
    assert cpu.xnnpack_sums_float16_in_float16()


def test_kvexport_threads_sizes_each_runtime_s_pool(artifact, monkeypatch, capsys):
    from executorch.extension.pybindings.portable_lib import _threadpool_get_thread_count

    from kvexport.runtime.programs import load_program
    from tests.helpers import assert_one_line_error, run_cli

    before = _threadpool_get_thread_count()
    for threads in (1, 3):
        monkeypatch.setenv("KVEXPORT_THREADS", str(threads))
        onnx = load_program(artifact("tiny-gemma3", "onnx"))
        assert onnx._session.get_session_options().intra_op_num_threads == threads
        load_program(artifact("tiny-gemma3", "executorch"))
        assert _threadpool_get_thread_count() == threads
    monkeypatch.setenv("KVEXPORT_THREADS", str(before))
    load_program(artifact("tiny-gemma3", "executorch"))  # the pool as this worker had it
    for wrong in ("0", "two"):
        monkeypatch.setenv("KVEXPORT_THREADS", wrong)
        code, _, err = run_cli(capsys, "run", artifact("tiny-gemma3", "onnx"), "--prompt", "Hi")
        assert_one_line_error(code, err, f"KVEXPORT_THREADS='{wrong}'", "at least 1")


# What an environment variable can hold: any text but NUL and lone surrogates.
ENV_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=12)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.one_of(ENV_TEXT, st.integers(-10, 10**12).map(str), st.sampled_from(["²", "٣", "1e3", " 4 ", "0x10"])))
def test_kvexport_threads_is_a_count_or_one_line(monkeypatch, value):
    """Whatever the variable holds: a count of 1 to MAX_THREADS, unset, or the one-line refusal
    (issue 58, class 6: a superscript digit or a huge number ended in a traceback)."""
    monkeypatch.setenv("KVEXPORT_THREADS", value)
    try:
        threads = cpu.runtime_threads()
    except InvalidOptionError as e:
        assert "\n" not in str(e) and str(e).startswith("KVEXPORT_THREADS=")
        return
    stripped = os.environ.get("KVEXPORT_THREADS", "").strip()
    assert threads is None if not stripped else threads == int(stripped) and 1 <= threads <= cpu.MAX_THREADS
