"""Rotary position embedding as ONNX Runtime's ``RotaryEmbedding`` kernel (``com.microsoft``):
one node per query and per key instead of the seven (two slices, a negation, a concat, two
products and a sum) that transformers' ``q * cos + rotate_half(q) * sin`` exports to.

While the ONNX graph is traced, ``rotary_as_kernel`` swaps the modeling module's
``apply_rotary_pos_emb`` for one that calls ``kvexport::rotary_embedding``, but only in a family
whose function computes exactly the standard rotation (checked on random inputs, not by name);
any other call (partial rotary, another layout) still runs the family's own code. The kernel
reads ``cos``/``sin`` tables indexed by position: the call's own rows are passed as the table,
with positions starting at 0, so no table of ``max_cache_len`` rows is stored.

After the export, ``fold_rotations_into_attention`` moves a full-attention layer's rotations into
its ``GroupQueryAttention`` node (``do_rotary``), which does need those tables (see below).
"""

from __future__ import annotations

import contextlib
import sys

import torch

from .graph import attribute, prune


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


# After the export: each layer's two RotaryEmbedding nodes become its GroupQueryAttention's own
# rotation (``do_rotary``), as onnxruntime-genai's models do. The kernel derives each token's
# position from its lengths (``seqlens_k`` = P + T - 1; absolute positions on a sliding layer's
# window-sized buffer too) and reads ``cos``/``sin`` tables indexed by position, so the tables get
# ``max_cache_len`` rows.


def fold_rotations_into_attention(path, max_cache_len: int) -> int:
    """Rewrite the ONNX model at ``path`` (its external data untouched); return how many attention
    nodes now rotate their own query and key."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in [*graph.input, *graph.value_info] if v.type.tensor_type.HasField("shape")}
    folds = []  # (attention node, its query's and key's chains)
    for node in graph.node:
        if node.op_type == "GroupQueryAttention" and node.domain == "com.microsoft":
            chains = [_rotation_chain(producers, node.input[i]) for i in (0, 1)]
            if None not in chains and chains[0].input[2:4] == chains[1].input[2:4]:
                folds.append((node, chains))
    # The translation rotates token i by row i of the call's tables (position ids 0): those rows
    # computed for a call of max_cache_len tokens at position 0 are the tables by position, if a
    # position's rotation does not depend on the call it is in. One-token calls at position 1 (0
    # rotates by nothing) and at the last position must find those rows: where they do not (a
    # rotation that changes with the call's length, as transformers' longrope does), the layers
    # keep their own RotaryEmbedding nodes.
    if not folds:
        return 0
    names = sorted({name for _, chains in folds for name in chains[0].input[1:4]})
    values = _evaluate(model, path, names, max_cache_len)
    probes = {row: _evaluate(model, path, names, 1, start=row) for row in {min(1, max_cache_len - 1), max_cache_len - 1}}

    def row_of(table, row: int):
        return table[0] if len(table) == 1 else table[row]  # a one-token call's own row, or a constant table's

    def by_position(chain) -> bool:
        return not values[chain.input[1]].any() and all(
            probe is not None and np.allclose(values[name][row], row_of(probe[name], row), rtol=0, atol=1e-6)
            for row, probe in probes.items() for name in chain.input[2:4]
        )

    folds = [(node, chains) for node, chains in folds if values is not None and by_position(chains[0])]
    if not folds:
        return 0
    # The kernel's tables are in its query's type (a family whose rotation takes float32 tables and
    # casts the result, LFM3's, would otherwise bind T to two types in a float16 graph).
    logits = next(v for v in graph.output if v.name == "logits").type.tensor_type.elem_type
    dtype = helper.tensor_dtype_to_np_dtype(logits)
    tables = _add_tables(graph, {name: values[name].astype(dtype) for _, chains in folds for name in chains[0].input[2:4]})
    added = {}  # attention node -> the nodes it now reads that the graph did not have (placed before it)
    for node, chains in folds:
        for slot, rotation in zip((0, 1), chains):
            node.input[slot] = _sequence_first(rotation.input[0], producers, ranks, added.setdefault(node.name, []))
        cos_sin = [tables[name] for name in chains[0].input[2:4]]
        if len(node.input) > 7:  # the node has later inputs (head_sink): cos and sin are its empty slots 7, 8
            node.input[7], node.input[8] = cos_sin
        else:
            node.input.extend(cos_sin)
        node.attribute.append(helper.make_attribute("do_rotary", 1))
    if any(added.values()):
        graph.initializer.append(numpy_helper.from_array(np.array([0, 0, -1], np.int64), _FLAT_SHAPE))
    nodes = [new for node in graph.node for new in (*added.get(node.name, ()), node)]
    del graph.node[:]
    graph.node.extend(nodes)
    prune(graph)
    onnx.save(model, str(path))
    return len(folds)


_FLAT_SHAPE = "rotary_flat_shape"


def _sequence_first(heads_first: str, producers, ranks, added: list) -> str:
    """The unrotated ``[1, heads, T, D]`` tensor as the kernel's ``[1, T, heads * D]``: the
    projection's own output where it was only reshaped and transposed (the usual case), else a
    Transpose and a Reshape. Gemma 3 normalizes each head after the transpose: the norm (over the
    last axis, which the transpose keeps) is then applied before it instead, and neither transpose
    is left; every step pays each node's dispatch."""
    from onnx import helper

    transpose = producers.get(heads_first)
    norm = transpose if transpose is not None and transpose.op_type == "SimplifiedLayerNormalization" else None
    if norm is not None and attribute(norm, "axis", -1) in (-1, 3):
        transpose = producers.get(norm.input[0])
    if transpose is not None and transpose.op_type == "Transpose" and _perm(transpose) == [0, 2, 1, 3]:
        reshape = producers.get(transpose.input[0])
        if norm is not None:
            sequence_first = f"{heads_first}_sequence_first"
            moved = helper.make_node(norm.op_type, [transpose.input[0], *norm.input[1:]], [sequence_first],
                                     name=sequence_first, domain=norm.domain)
            moved.attribute.extend(norm.attribute)
            added.append(moved)
        elif reshape is not None and reshape.op_type == "Reshape" and ranks.get(reshape.input[0]) == 3:
            return reshape.input[0]
        else:
            sequence_first = transpose.input[0]
    else:
        sequence_first = f"{heads_first}_sequence_first"
        added.append(helper.make_node("Transpose", [heads_first], [sequence_first], name=sequence_first, perm=[0, 2, 1, 3]))
    flat = f"{heads_first}_flat"
    added.append(helper.make_node("Reshape", [sequence_first, _FLAT_SHAPE], [flat], name=flat))
    return flat


def _perm(node) -> list[int] | None:
    return next((list(a.ints) for a in node.attribute if a.name == "perm"), None)


def _rotation_chain(producers, value):
    """The RotaryEmbedding node behind an attention input of the translation's shape
    ``Reshape(Transpose(RotaryEmbedding(x)))`` (``x`` heads-first, ``[1, heads, T, D]``), if it is one."""
    for op in ("Reshape", "Transpose", "RotaryEmbedding"):
        node = producers.get(value)
        if node is None or node.op_type != op or (op == "Transpose" and _perm(node) != [0, 2, 1, 3]):
            return None
        value = node.input[0]
    if any(a.name == "interleaved" and a.i != 0 for a in node.attribute) or len(node.input) != 4:
        return None
    return node  # the RotaryEmbedding


_AS_FLOAT = "__as_float32"


def _bfloat16(array):
    import ml_dtypes

    return array.astype(ml_dtypes.bfloat16)


def _evaluate(model, path, names: list[str], tokens: int, start: int = 0):
    """The values of ``names`` in a call of ``tokens`` tokens at position ``start``, computed by the graph
    itself (the nodes they depend on, run by ONNX Runtime); None where they depend on anything
    but the call's tokens and position."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import external_data_helper, helper, numpy_helper

    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    initializers = {i.name: i for i in graph.initializer}
    needed, stack = set(), list(names)
    while stack:  # the names' ancestors
        name = stack.pop()
        if name in needed:
            continue
        needed.add(name)
        if name in producers:
            stack.extend(i for i in producers[name].input if i)
    inputs = [v for v in graph.input if v.name in needed]
    if {v.name for v in inputs} - {"input_ids", "attention_mask"}:
        return None
    constants = []
    for name in needed & set(initializers):
        tensor = onnx.TensorProto()
        tensor.CopyFrom(initializers[name])
        if external_data_helper.uses_external_data(tensor):
            external_data_helper.load_external_data_for_tensor(tensor, str(path.parent))
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]
        constants.append(tensor)
    values = {t.name: numpy_helper.to_array(t) for t in constants if t.name in names}
    computed = [n for n in names if n not in values]
    if computed:
        types = {v.name: v.type.tensor_type.elem_type for v in graph.value_info}
        nodes = [n for n in graph.node if any(o in needed for o in n.output)]
        # ONNX Runtime's Python binding returns no bfloat16 array: such a table is read as float32
        # (exact) and turned back.
        bf16 = {n for n in computed if types.get(n) == onnx.TensorProto.BFLOAT16}
        nodes += [helper.make_node("Cast", [n], [f"{n}{_AS_FLOAT}"], to=onnx.TensorProto.FLOAT) for n in sorted(bf16)]
        outputs = [helper.make_tensor_value_info(f"{n}{_AS_FLOAT}", onnx.TensorProto.FLOAT, None) if n in bf16
                   else helper.make_tensor_value_info(n, types.get(n, onnx.TensorProto.UNDEFINED), None) for n in computed]
        sub = helper.make_model(
            helper.make_graph(nodes, "rotary_tables", inputs, outputs, constants),
            opset_imports=model.opset_import, ir_version=model.ir_version,
        )  # fmt: skip
        session = ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"])
        feeds = {"input_ids": np.zeros((1, tokens), np.int64), "attention_mask": np.ones((1, start + tokens), np.int64)}
        results = session.run(None, {v.name: feeds[v.name] for v in inputs})
        values |= {n: _bfloat16(r) if n in bf16 else r for n, r in zip(computed, results)}
    return values


def _add_tables(graph, arrays: dict) -> dict[str, str]:
    """Each array as an initializer, one per distinct value; returns ``{name: initializer name}``."""
    import numpy as np
    from onnx import numpy_helper

    result, kept = {}, []  # kept: (initializer name, array)
    for name, array in arrays.items():
        same = next((kept_name for kept_name, kept_array in kept if np.array_equal(kept_array, array)), None)
        if same is None:
            same = f"rotary_table_{len(kept)}"
            kept.append((same, array))
            graph.initializer.append(numpy_helper.from_array(array, same))
        result[name] = same
    return result
