"""Rotary position embedding as ONNX Runtime's ``RotaryEmbedding`` kernel (``com.microsoft``):
one node per query and per key instead of the seven (two slices, a negation, a concat, two
products and a sum) that transformers' ``q * cos + rotate_half(q) * sin`` exports to.

While the ONNX graph is traced, ``rotary_as_kernel`` swaps the modeling module's
``apply_rotary_pos_emb`` for one that calls ``kvexport::rotary_embedding``, but only in a family
whose function computes exactly the standard rotation (checked on random inputs, not by name);
any other call (partial rotary, another layout) still runs the family's own code. The kernel
reads ``cos``/``sin`` tables indexed by position: the call's own rows are passed as the table,
with positions starting at 0, so no table of ``max_cache_len`` rows is stored.
"""

from __future__ import annotations

import contextlib
import sys

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotation: ``x * cos + rotate_half(x) * sin`` with full-width ``cos``/``sin``."""
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated_half * sin


@torch.library.custom_op("kvexport::rotary_embedding", mutates_args=())
def rotary_embedding(x: torch.Tensor, cos_half: torch.Tensor, sin_half: torch.Tensor) -> torch.Tensor:
    """``x [1, heads, T, D]`` rotated by the call's angles: ``cos_half``/``sin_half [T, D/2]``, the
    first half of transformers' ``cos``/``sin`` (its two halves are equal: ``cat(freqs, freqs)``)."""
    cos, sin = torch.cat((cos_half, cos_half), dim=-1), torch.cat((sin_half, sin_half), dim=-1)
    return _rotate(x, cos.to(x.dtype), sin.to(x.dtype))


@rotary_embedding.register_fake
def _(x, cos_half, sin_half):
    return torch.empty_like(x)


def _onnx_schema():
    """The ``com.microsoft`` op's signature as far as we use it (onnx has no schema for contrib ops)."""
    from onnx.defs import OpSchema

    def param(name, type_str):
        return OpSchema.FormalParameter(name, type_str)

    return OpSchema(
        "RotaryEmbedding",
        "com.microsoft",
        1,
        inputs=[param("input", "T"), param("position_ids", "M"), param("cos_cache", "T"), param("sin_cache", "T")],
        outputs=[param("output", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], ""), ("M", ["tensor(int64)"], "")],
    )


def _rotary_embedding_onnx(x, cos_half, sin_half):
    import onnxscript
    from onnxscript import opset18 as op

    kernel = onnxscript.values.Op(onnxscript.values.Opset("com.microsoft", 1), "RotaryEmbedding", _onnx_schema())
    # position_ids [1] = the first row of the tables: row i of the call's tables rotates token i.
    return kernel(x, op.Constant(value_ints=[0]), cos_half, sin_half)


ONNX_TRANSLATIONS = {torch.ops.kvexport.rotary_embedding.default: _rotary_embedding_onnx}


def _computes_the_standard_rotation(apply) -> bool:
    """Whether ``apply(q, k, cos, sin)`` is transformers' standard rotation, on random inputs."""
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 3, 8, generator=generator), torch.randn(1, 2, 3, 8, generator=generator)
    angles = torch.randn(1, 3, 4, generator=generator)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    try:
        q_out, k_out = apply(q, k, cos, sin)
    except Exception:  # another signature or layout: not the standard function
        return False
    expected = _rotate(q, cos[:, None], sin[:, None]), _rotate(k, cos[:, None], sin[:, None])
    return all(
        isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want, atol=1e-6)
        for got, want in zip((q_out, k_out), expected)
    )


def _kernel_apply(original):
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        fits = (
            not args and not kwargs and q.dim() == k.dim() == 4 and cos.dim() == sin.dim() == 3
            and cos.shape[0] == 1 and cos.shape[-1] == q.shape[-1] == k.shape[-1] and q.shape[-1] % 2 == 0
        )  # fmt: skip
        if not fits:
            return original(q, k, cos, sin, *args, **kwargs)
        half = q.shape[-1] // 2
        cos_half, sin_half = cos[0, :, :half], sin[0, :, :half]
        return (torch.ops.kvexport.rotary_embedding(q, cos_half, sin_half),
                torch.ops.kvexport.rotary_embedding(k, cos_half, sin_half))  # fmt: skip

    return apply_rotary_pos_emb


@contextlib.contextmanager
def rotary_as_kernel(model: torch.nn.Module):
    """While inside, the model's modeling modules rotate through ``kvexport::rotary_embedding``
    where their ``apply_rotary_pos_emb`` is the standard one; yields how many modules were swapped."""
    modules = {sys.modules[type(m).__module__] for m in model.modules()}
    originals = {
        module: module.apply_rotary_pos_emb
        for module in modules
        if callable(getattr(module, "apply_rotary_pos_emb", None))
        and _computes_the_standard_rotation(module.apply_rotary_pos_emb)
    }
    for module, original in originals.items():
        module.apply_rotary_pos_emb = _kernel_apply(original)
    try:
        yield len(originals)
    finally:
        for module, original in originals.items():
            module.apply_rotary_pos_emb = original
