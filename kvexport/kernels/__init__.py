"""kvexport's own ExecuTorch kernels: ``kvexport::decode_sdpa`` and ``decode_sdpa_int8``, the
attention of a short call (a decode step, a speculative verification) over a full layer's float32
or int8 cache (``--decode-attention kvexport``, ``decode_sdpa.cpp``).

Two halves, as ExecuTorch's own LLM ops have them:

- the op for ``torch.export`` (``define_ops``): its schema, functional and ``.out`` (the variant an
  ExecuTorch program calls), with torch's math as its eager implementation, which tests compare
  the kernel with;
- the kernel for ExecuTorch's runtime (``load_kernels``): ``decode_sdpa.cpp`` built once per
  machine with the C++ compiler (``$CXX``, else ``c++``) against the headers and libraries of the
  installed ExecuTorch, for this CPU (``-march=native``), cached under
  ``$KVEXPORT_CACHE/kernels/``, and loaded into the process, where it registers itself with
  ExecuTorch's kernel registry (one registry: the Python runtime and TextLLMRunner link the same
  ``libexecutorch.so``). A program that calls the op loads only once it is there.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..errors import KvexportError

SOURCE = Path(__file__).with_name("decode_sdpa.cpp")
# Calls of up to this many tokens take the kernel (decode steps, verifications of up to 15 drafts);
# a longer one (a prompt's) the stock kernel, whose matrix products do its many rows' work faster.
MOST_TOKENS = 16
# ET_EVENT_TRACER_ENABLED, as the pip runtime is built: the kernel's calls are named in an ETDump
# trace (scripts/profile_pte.py), and cost nothing where no tracer is attached.
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC", "-DET_USE_THREADPOOL",
         "-DET_EVENT_TRACER_ENABLED"]


@functools.cache
def define_ops() -> None:
    """``kvexport::decode_sdpa(q [1, T, H, D], k, v [1, S, KV, D], end, scale) -> [1, T, H, D]``:
    softmax(q·kᵀ·scale)·v, the query's rows positions ``end - T .. end - 1``, each attending to the
    positions up to its own (causal), each query head to its group's KV head; contiguous whatever
    the query's strides (``torch.cond``'s branches must agree on them)."""
    import torch

    lib = torch.library.Library("kvexport", "DEF")
    lib.define("decode_sdpa(Tensor q, Tensor k, Tensor v, SymInt end, float scale) -> Tensor")
    lib.define("decode_sdpa.out(Tensor q, Tensor k, Tensor v, SymInt end, float scale, *, Tensor(a!) out) -> Tensor(a!)")
    lib.impl("decode_sdpa", decode_sdpa_reference, "CompositeExplicitAutograd")
    lib.impl("decode_sdpa.out", _reference_out, "CompositeExplicitAutograd")
    torch.library.register_fake("kvexport::decode_sdpa", lambda q, k, v, end, scale: q.new_empty(q.shape), lib=lib)
    torch.library.register_fake("kvexport::decode_sdpa.out", lambda q, k, v, end, scale, *, out: out, lib=lib)
    # The same over an int8 cache: each row (x_q - zero_point) * scale, one scale and zero point a row.
    int8 = "Tensor q, Tensor k, Tensor k_scales, Tensor k_zero_points, Tensor v, Tensor v_scales, Tensor v_zero_points, SymInt end, float scale"
    lib.define(f"decode_sdpa_int8({int8}) -> Tensor")
    lib.define(f"decode_sdpa_int8.out({int8}, *, Tensor(a!) out) -> Tensor(a!)")
    lib.impl("decode_sdpa_int8", decode_sdpa_int8_reference, "CompositeExplicitAutograd")
    lib.impl("decode_sdpa_int8.out", _int8_reference_out, "CompositeExplicitAutograd")
    torch.library.register_fake("kvexport::decode_sdpa_int8", lambda q, *rows_end_scale: q.new_empty(q.shape), lib=lib)
    torch.library.register_fake("kvexport::decode_sdpa_int8.out", lambda q, *rows_end_scale, out: out, lib=lib)
    define_ops.library = lib  # the definitions last as long as the Library object


def decode_sdpa_reference(q, k, v, end: int, scale: float):
    """The op in torch's math (float32 products and softmax)."""
    import torch

    tokens, heads, kv_heads = q.shape[1], q.shape[2], k.shape[2]
    keys = k[0, :end].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1).float()  # [H, end, D]
    values = v[0, :end].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1).float()
    scores = torch.einsum("thd,hpd->htp", q[0].float(), keys) * scale
    rows = torch.arange(end - tokens, end)[:, None]
    scores = scores.masked_fill(torch.arange(end)[None, :] > rows, float("-inf"))  # causal
    return torch.einsum("htp,hpd->thd", torch.softmax(scores, dim=-1), values)[None].to(q.dtype)


def _reference_out(q, k, v, end, scale, *, out):
    return out.copy_(decode_sdpa_reference(q, k, v, end, scale))


def decode_sdpa_int8_reference(q, k, k_scales, k_zero_points, v, v_scales, v_zero_points, end: int, scale: float):
    """``decode_sdpa`` over the int8 rows dequantized."""
    keys = (k[:, :end].float() - k_zero_points[:, :end].float()) * k_scales[:, :end]
    values = (v[:, :end].float() - v_zero_points[:, :end].float()) * v_scales[:, :end]
    return decode_sdpa_reference(q, keys, values, end, scale)


def _int8_reference_out(q, k, k_scales, k_zero_points, v, v_scales, v_zero_points, end, scale, *, out):
    return out.copy_(decode_sdpa_int8_reference(q, k, k_scales, k_zero_points, v, v_scales, v_zero_points, end, scale))


@functools.cache
def load_kernels() -> Path:
    """Build (once per machine and ExecuTorch version) and load the kernel library; its path."""
    library = _build()
    ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    return library


def _cache_dir() -> Path:
    return Path(os.environ.get("KVEXPORT_CACHE", Path.home() / ".cache" / "kvexport")) / "kernels"


def _cpu() -> str:
    """This CPU's model and features, as Linux lists them (empty elsewhere)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(dict.fromkeys(line for line in lines if line.split(":")[0].strip() in wanted))


def _build() -> Path:
    import executorch
    import torch

    executorch_dir, torch_dir = Path(next(iter(executorch.__path__))), Path(torch.__file__).parent  # a namespace package
    compiler = os.environ.get("CXX") or "c++"
    compile_ = [compiler, *FLAGS, f"-I{executorch_dir / 'include'}", f"-I{torch_dir / 'include'}", str(SOURCE)]
    link = [f"-L{executorch_dir / 'lib'}", "-lexecutorch", "-lexecutorch_threadpool", f"-Wl,-rpath,{executorch_dir / 'lib'}"]
    # What the library depends on: its source and command, the ExecuTorch and torch it was built
    # against, and this CPU (-march=native; a cache shared between machines keeps one per kind).
    versions = [importlib.metadata.version(name) for name in ("executorch", "torch")]
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *compile_, *link, *versions, sys.version, _cpu()]).encode()).hexdigest()[:16]
    library = _cache_dir() / key / "libkvexport_kernels.so"
    if library.is_file():
        return library
    if shutil.which(compiler) is None:
        raise KvexportError(
            f"this artifact calls kvexport's decode kernel (--decode-attention kvexport), which is built here once with a "
            f"C++ compiler, and there is none ({compiler!r} not found: install one, e.g. g++, or set CXX); or export "
            "without --decode-attention kvexport"
        )
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:  # built beside it, then renamed: never half-written
        built = Path(tmp) / library.name
        result = subprocess.run([*compile_, "-o", str(built), *link], capture_output=True, text=True)
        if result.returncode != 0:
            raise KvexportError(f"building kvexport's decode kernel with {compiler} failed:\n{result.stderr[-2000:]}")
        os.replace(built, library)
    return library
