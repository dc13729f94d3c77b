"""Changes made to a model before tracing, where transformers' default code path is one that
``torch.export`` or a target runtime cannot take. Each picks an equivalent computation through a
switch transformers itself offers, so the modeling code still runs unchanged; the eager reference
that ``check`` compares against keeps transformers' defaults.

Keyed on what a model has (e.g. mixture-of-experts layers), not on its family name, so a family
that shares the feature needs no code of its own.
"""

from __future__ import annotations

import torch
from torch import nn


def prepare_for_export(model: nn.Module) -> None:
    _experts_as_batched_matmuls(model)
    _short_convolutions_with_state(model)
    _linear_attention_with_state(model)
    _mamba2_with_state(model)
    _activation_sparsity_with_fixed_quantile(model)
    _complex_rotary_as_real(model)


def _experts_as_batched_matmuls(model: nn.Module) -> None:
    """Mixture-of-experts layers (GPT-OSS, Mixtral, Qwen3-MoE, ...).

    transformers' default experts implementation, ``grouped_mm``, runs on the CPU through its own
    custom op (``transformers::grouped_mm_fallback``), which no target runtime has a kernel for;
    its ``eager`` one loops over the experts a call hits (data-dependent control flow).
    ``batched_mm`` gathers each token's top-k expert weights and multiplies in one batched matmul:
    plain aten ops and no shape that depends on the routing.
    """
    can_set = getattr(model, "_can_set_experts_implementation", None)
    if can_set is not None and can_set():
        model.set_experts_implementation("batched_mm")


def _short_convolutions_with_state(model: nn.Module) -> None:
    """LFM2's short gated convolutions (``*ShortConv``: LFM2, LFM2-MoE, LFM3).

    transformers keeps their state in its own cache object, which the export does not pass (kvexport's
    caches are its own); without one a convolution sees every call as a new sequence. Here it
    convolves over the layer's ``ConvState``, the same gated computation: ``out_proj(C * conv(B * x))``
    with ``B, C, x`` from ``in_proj``."""

    def convolve(self, hidden_states, call):
        b, c, x = self.in_proj(hidden_states).transpose(-1, -2).chunk(3, dim=-2)
        y = c * call.layers[self.layer_idx].convolve(b * x, self.conv.weight, self.conv.bias, call)
        return self.out_proj(y.transpose(-1, -2).contiguous())

    for module in model.modules():
        if type(module).__name__.endswith("ShortConv") and hasattr(module, "conv_kernel_size"):
            _run_with_state(module, convolve)


def _linear_attention_with_state(model: nn.Module) -> None:
    """Gated-delta linear attention (``*GatedDeltaNet``: Qwen 3.5, Qwen 3.5 MoE, Qwen3-Next).

    transformers keeps its convolution and recurrent states in its own cache, picks the recurrent or
    the chunked form by the call's length (a branch on ``T``) and loops over chunks (a loop over
    ``T``). Here the same projections, convolution, gate and norm run around the layer's
    ``GatedDeltaState``, which computes the call as one chunk."""
    from torch.nn import functional as F
    from transformers.activations import ACT2FN

    def attend(self, hidden_states, call):
        batch, n, _ = hidden_states.shape
        mixed_qkv, z, b, a = _gated_delta_projections(self, hidden_states)
        state = call.layers[self.layer_idx]
        mixed_qkv = state.conv.convolve(mixed_qkv.transpose(1, 2), self.conv1d.weight, self.conv1d.bias, call)
        mixed_qkv = ACT2FN[self.activation](mixed_qkv).transpose(1, 2)
        query, key, value = mixed_qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.reshape(batch, n, -1, self.head_k_dim)
        key = key.reshape(batch, n, -1, self.head_k_dim)
        value = value.reshape(batch, n, -1, self.head_v_dim)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = state.delta_rule(query, key, value, g, b.sigmoid(), call)
        out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(out.reshape(batch, n, -1))

    for module in model.modules():
        if type(module).__name__.endswith("GatedDeltaNet") and hasattr(module, "A_log"):
            _run_with_state(module, attend)


def _mamba2_with_state(model: nn.Module) -> None:
    """Mamba-2 layers (Granite 4 hybrid's ``*MambaLayer``, Bamba's, Falcon-H1's and Nemotron-H's ``*Mixer``).

    As for the gated delta rule: transformers branches on the call's length (its 1-token update or
    its chunked scan) and loops over chunks; here the same projection, convolution, step, gated norm
    and output run around the layer's ``Mamba2State``, one chunk a call. Falcon-H1's mixer also
    scales its input (``ssm_in_multiplier``) and its projection (``mup_vector``), and without its
    norm (``mamba_rms_norm`` false) gates the scan's output alone, as its chunked scan does."""
    from torch.nn import functional as F
    from transformers.activations import ACT2FN

    def scan(self, hidden_states, call):
        batch, n, _ = hidden_states.shape
        groups = self.n_groups * self.ssm_state_size
        if hasattr(self, "ssm_in_multiplier"):
            hidden_states = hidden_states * self.ssm_in_multiplier
        projected = self.in_proj(hidden_states)
        if hasattr(self, "mup_vector"):
            projected = projected * self.mup_vector
        gate, xbc, dt = projected.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        state = call.states[self.layer_idx]
        xbc = ACT2FN[self.activation](state.conv.convolve(xbc.transpose(1, 2), self.conv1d.weight, self.conv1d.bias, call))
        x, b, c = xbc.transpose(1, 2).split([self.intermediate_size, groups, groups], dim=-1)
        dt = _mamba2_step(F.softplus(dt + self.dt_bias.to(dt.dtype)), self.time_step_limit, call)
        y = state.scan(
            x.reshape(batch, n, self.num_heads, self.head_dim), dt, -torch.exp(self.A_log.float()),
            b.reshape(batch, n, self.n_groups, -1), c.reshape(batch, n, self.n_groups, -1), self.D, call,
        )  # fmt: skip
        y = y.reshape(batch, n, -1)
        y = self.norm(y, gate) if getattr(self, "mamba_rms_norm", True) else y * F.silu(gate)
        return self.out_proj(y.to(hidden_states.dtype))

    for module in model.modules():
        if hasattr(module, "ssm_state_size") and hasattr(module, "A_log") and hasattr(module, "in_proj"):
            _run_with_state(module, scan)


def _mamba2_step(dt: torch.Tensor, limit, call) -> torch.Tensor:
    """The steps ``dt`` ``[1, T, heads]`` as transformers' Mamba-2 mixers take them: clamped to
    ``limit`` (``time_step_limit``; Nemotron-H's is ``(time_step_min, inf)``) in the chunked scan, not
    in the 1-token update. The update runs when the layer already holds a state (a call past position
    0) and the call is one token; any other call, a one-token prompt included, is a chunked scan. Both
    conditions are tensors here, so one program takes every call."""
    positions = call.positions
    one_token_update = (positions[:1] > 0) & (positions[-1:] == positions[:1])
    return torch.where(one_token_update, dt, torch.clamp(dt, *limit))


def _activation_sparsity_with_fixed_quantile(model: nn.Module) -> None:
    """Activation sparsity (Gemma 3n's MLPs with ``activation_sparsity_pattern``: ``_gaussian_topk``).

    transformers keeps the gate's activations above ``mean + std * q``, ``q`` the standard normal's
    quantile at the layer's target sparsity, which it computes at every call (``Normal.icdf``: an
    ``erfinv``, for which neither ExecuTorch nor ONNX has a kernel). ``q`` depends on the config
    alone: here it is computed once, by the same call, and the cutoff from it as transformers does."""
    import types

    from torch.distributions.normal import Normal

    def gaussian_topk(self, inputs):
        multiplier = self.kvexport_normal_quantile.to(inputs.dtype)
        mean = torch.mean(inputs, dim=-1, keepdim=True)
        std = torch.std(inputs, dim=-1, keepdim=True, unbiased=False)
        return nn.functional.relu(inputs - (mean + std * multiplier))

    for module in model.modules():
        if callable(getattr(module, "_gaussian_topk", None)) and getattr(module, "activation_sparsity", 0.0) > 0.0:
            sparsity = torch.tensor(module.activation_sparsity, dtype=torch.float32)
            module.register_buffer("kvexport_normal_quantile", Normal(0, 1).icdf(sparsity), persistent=False)
            module._gaussian_topk = types.MethodType(gaussian_topk, module)


def _complex_rotary_as_real(model: nn.Module) -> None:
    """Rotary embeddings that multiply complex numbers (Llama 4: ``torch.polar``, ``view_as_complex``).

    Neither target runs complex tensors (ExecuTorch's program fails to load, the ONNX exporter has
    no decomposition for them). Here the rotary module returns the same angles' ``cos`` and ``sin``
    (``[B, T, D/2, 2]``) and the attention rotates each interleaved pair ``(x0, x1)`` with real ops:
    ``(x0 cos - x1 sin, x0 sin + x1 cos)``, the complex product written out. Llama 4's attention
    also scales a NoPE layer's queries by its positions (``attn_temperature_tuning``), which
    transformers counts from its own cache: under kvexport they are the call's positions."""
    import types

    rotaries = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding") and _returns_complex(m)]
    if not rotaries:
        return
    attentions = [m for m in model.modules() if all(hasattr(m, a) for a in ("use_rope", "attn_temperature_tuning", "q_proj"))]
    if not attentions:  # the rotation is the attention's code: only Llama 4's is written out here
        from ..errors import UnsupportedModelError

        raise UnsupportedModelError(
            f"{type(model).__name__}'s rotary embedding is complex-valued, which neither target runs, and kvexport "
            "rotates in real numbers only Llama 4's attention"
        )
    for rotary in rotaries:
        rotary.forward = types.MethodType(_real_rotary_forward, rotary)
    for module in attentions:
        module.forward = types.MethodType(_llama4_attention_forward, module)


def _returns_complex(rotary: nn.Module) -> bool:
    """Whether a rotary module's output is complex (its forward run on one position)."""
    try:
        with torch.no_grad():
            out = rotary(torch.zeros(1), torch.zeros((1, 1), dtype=torch.long))
    except Exception:  # another signature: not one this adapter knows
        return False
    return isinstance(out, torch.Tensor) and out.is_complex()


@torch.no_grad()
def _real_rotary_forward(self, x, position_ids):
    """``cos`` and ``sin`` of the angles Llama 4's rotary module takes the polar form of, ``[B, T, D/2, 2]``."""
    freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
    return torch.stack([freqs.cos(), freqs.sin()], dim=-1) * self.attention_scaling


def rotate_pairs(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """``x [B, T, heads, D]`` with each pair ``(x[2i], x[2i+1])`` rotated by ``cos_sin [B, T, D/2, 2]``:
    transformers' ``apply_rotary_emb`` (a complex product) in real arithmetic, in float32."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos, sin = cos_sin[:, :, None, :, 0], cos_sin[:, :, None, :, 1]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(3).type_as(x)


def _llama4_attention_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
    """``Llama4TextAttention.forward`` with the rotation of ``rotate_pairs`` and, under kvexport, the
    temperature of a NoPE layer's queries from the call's positions."""
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    input_shape = hidden_states.shape[:-1]
    query = self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim)
    key = self.k_proj(hidden_states).view(*input_shape, -1, self.head_dim)
    value = self.v_proj(hidden_states).view(*input_shape, -1, self.head_dim).transpose(1, 2)
    if self.use_rope:
        query, key = rotate_pairs(query, position_embeddings), rotate_pairs(key, position_embeddings)
    if hasattr(self, "qk_norm"):
        query, key = self.qk_norm(query), self.qk_norm(key)
    if self.attn_temperature_tuning and not self.use_rope:
        call = kwargs.get("kvexport_call")
        if call is not None:
            positions = call.positions
        else:
            past = past_key_values.get_seq_length(self.layer_idx) if past_key_values is not None else 0
            positions = torch.arange(input_shape[-1], device=hidden_states.device) + past
        scales = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
        query = (query * scales.view(1, input_shape[-1], 1, 1)).to(query.dtype)
    query, key = query.transpose(1, 2), key.transpose(1, 2)
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, self.layer_idx)
    eager = sys.modules[type(self).__module__].eager_attention_forward  # the family's own
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager)
    out, weights = attention(
        self, query, key, value, attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs,
    )  # fmt: skip
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def _run_with_state(module: nn.Module, run) -> None:
    """``module``'s forward becomes ``run(module, hidden_states, call)`` where kvexport passes its call
    (``kvexport_call``: the layer's state is ``call.layers[module.layer_idx]``); without it (plain
    transformers) the module's own forward runs."""
    import types

    original = module.forward

    def forward(self, hidden_states, *args, kvexport_call=None, **kwargs):
        if kvexport_call is None:
            return original(hidden_states, *args, **kwargs)
        return run(self, hidden_states, kvexport_call)

    module.forward = types.MethodType(forward, module)


def _gated_delta_projections(module: nn.Module, hidden_states):
    """``(queries, keys and values concatenated [B, T, channels], z [B, T, heads, size], b, a)`` from
    the layer's input projections: Qwen 3.5's four, or Qwen3-Next's two interleaved ones."""
    batch, n, _ = hidden_states.shape
    if hasattr(module, "in_proj_qkvz"):
        query, key, value, z, b, a = module.fix_query_key_value_ordering(
            module.in_proj_qkvz(hidden_states), module.in_proj_ba(hidden_states)
        )
        return torch.cat([x.reshape(batch, n, -1) for x in (query, key, value)], dim=-1), z, b, a
    z = module.in_proj_z(hidden_states).reshape(batch, n, -1, module.head_v_dim)
    return module.in_proj_qkv(hidden_states), z, module.in_proj_b(hidden_states), module.in_proj_a(hidden_states)


def fixed_rotary_frequencies(model: nn.Module, max_cache_len: int) -> None:
    """Rotary embeddings whose frequencies transformers recomputes from the sequence's length
    (``dynamic_rope_update``: rope types ``dynamic`` and ``longrope``) keep the ones eager uses for
    every sequence of at most ``max_cache_len`` tokens.

    transformers decides at each forward call from ``max(position_ids) + 1``: dynamic NTK changes
    nothing up to ``max_position_embeddings`` (its update is then a data-dependent branch that
    ``torch.export`` cannot trace), longrope takes its short factors up to
    ``original_max_position_embeddings`` (its update selects between the two sets). Up to those
    lengths both rotate with the frequencies the model was built with, ``original_inv_freq``;
    ``architecture.check_rope`` refuses a longer cache. A module whose own rope type is something
    else (Hunyuan's ``ntk_alpha``) is left alone: transformers never updates it.
    """
    import types

    from ..errors import UnsupportedModelError

    for module in model.modules():
        rope_forward = _under_dynamic_rope_update(getattr(type(module), "forward", None))
        rope_types = getattr(module, "rope_type", None)
        if rope_forward is None or rope_types is None:
            continue
        by_layer = rope_types.items() if isinstance(rope_types, dict) else [(None, rope_types)]
        updated = [(layer, kind) for layer, kind in by_layer if "dynamic" in kind or kind == "longrope"]
        for layer, kind in updated:
            prefix = f"{layer}_" if layer else ""
            params = module.config.rope_parameters[layer] if layer else module.config.rope_parameters
            reach = module.original_max_seq_len if "dynamic" in kind else params["original_max_position_embeddings"]
            if max_cache_len > reach:
                raise UnsupportedModelError(
                    f"rope type '{kind}' changes its frequencies past {reach} positions, within a cache of "
                    f"{max_cache_len}; export with --max-cache-len {reach} or less"
                )
            getattr(module, f"{prefix}inv_freq").copy_(getattr(module, f"{prefix}original_inv_freq"))
        if updated:
            module.forward = types.MethodType(torch.no_grad()(rope_forward), module)


def _under_dynamic_rope_update(forward):
    """The function ``forward`` is ``dynamic_rope_update`` of (through other decorators), or None."""
    from transformers.modeling_rope_utils import dynamic_rope_update

    wrapper_code = dynamic_rope_update(lambda self, x, position_ids: None).__code__
    while forward is not None:
        if getattr(forward, "__code__", None) is wrapper_code:
            return forward.__wrapped__
        forward = getattr(forward, "__wrapped__", None)
    return None
