"""Reference transformer FFNs (the oracle of flashflow's fused MLP).

Weights as ``nn.Linear`` stores them: for ``"swiglu"`` ``w_gate_up = cat([gate.weight,
up.weight])`` of shape ``(2·intermediate, hidden)`` and ``out = (silu(x·gateᵀ) ∘ x·upᵀ)·w_downᵀ``;
for ``"gelu"`` (tanh approximation, as GPT-2), ``"silu"`` and ``"relu"`` ``w_gate_up`` is fc1's
weight ``(intermediate, hidden)`` and ``out = act(x·w_gate_upᵀ)·w_downᵀ``; ``w_down`` is
``(hidden, intermediate)``.
"""
from __future__ import annotations

import math

import torch

# the activations the oracle covers: the fused kernels' own (tests/reference/test_mlp_reference.py
# checks the two lists agree; a reference never imports the code it checks)
ACTIVATIONS = ("swiglu", "gelu", "silu", "relu")


def activation_ref(name: str, a: torch.Tensor) -> torch.Tensor:
    if name in ("silu", "swiglu"):
        return a * torch.sigmoid(a)
    if name == "gelu":
        return 0.5 * a * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (a + 0.044715 * a ** 3)))
    if name == "relu":
        return torch.relu(a)
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")


def mlp_ref(x, w_gate_up, w_down, activation="swiglu"):
    """The FFN in the inputs' dtype (pass float64 tensors for an oracle)."""
    h = x @ w_gate_up.T
    if activation == "swiglu":
        inter = w_gate_up.shape[0] // 2
        h = activation_ref("silu", h[..., :inter]) * h[..., inter:]
    else:
        h = activation_ref(activation, h)
    return h @ w_down.T
