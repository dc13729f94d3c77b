"""The states of layers that do not attend (LFM2's convolutions, Qwen 3.5's linear attention,
Granite 4's Mamba-2 layers) on a graph that holds no state: each crosses the graph boundary as a
past input and a present output, which the runner passes as the next call's past. The arithmetic
is ``kv_cache``'s: only where the state comes from and goes to differs.

Unlike a KV buffer, a present cannot be bound to its past's memory: the graph reads the past after
it has begun writing the present (the recurrent state is read by the output's product and by the
update), so a runner keeps two buffers per state and swaps them.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kv_cache import ConvState, GatedDeltaState, Mamba2State, padded_chunk


class ExternalConvState(ConvState):
    """A convolution's state ``[1, channels, width]``: ``bind(past)``, ``presents()`` after the call."""

    def __init__(self, channels: int, width: int, dtype: torch.dtype):
        nn.Module.__init__(self)
        self.width = width
        self.shapes = [((1, channels, width), dtype)]
        self.state = self.present = None

    def bind(self, past: torch.Tensor) -> None:
        self.state = past

    def keep(self, state: torch.Tensor) -> None:
        self.present = state

    def presents(self) -> list[torch.Tensor]:
        return [self.present]


class ExternalGatedDeltaState(GatedDeltaState):
    """Linear attention's two states, its convolution's and its recurrent one (float32)."""

    def __init__(self, conv_state: tuple[int, int], recurrent_state: tuple[int, int, int], max_tokens: int, dtype):
        nn.Module.__init__(self)
        self.conv = ExternalConvState(*conv_state, dtype)
        self.chunk = padded_chunk(max_tokens)
        self.shapes = [*self.conv.shapes, ((1, *recurrent_state), torch.float32)]
        self.state = self.present = None

    def bind(self, past_conv: torch.Tensor, past_state: torch.Tensor) -> None:
        self.conv.bind(past_conv)
        self.state = past_state

    def keep(self, state: torch.Tensor) -> None:
        self.present = state

    def presents(self) -> list[torch.Tensor]:
        return [*self.conv.presents(), self.present]


class ExternalMamba2State(Mamba2State):
    """A Mamba-2 layer's two states, its convolution's and its state-space one (float32)."""

    def __init__(self, conv_state: tuple[int, int], recurrent_state: tuple[int, int, int], dtype):
        nn.Module.__init__(self)
        self.conv = ExternalConvState(*conv_state, dtype)
        self.shapes = [*self.conv.shapes, ((1, *recurrent_state), torch.float32)]
        self.state = self.present = None

    bind = ExternalGatedDeltaState.bind
    keep = ExternalGatedDeltaState.keep
    presents = ExternalGatedDeltaState.presents
