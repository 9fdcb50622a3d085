"""The FFN oracle against torch.nn's own layers and activations (float64, no Triton)."""
import pytest
import torch

from flashflow.reference.mlp import ACTIVATIONS, activation_ref, mlp_ref


def test_activations_match_torch():
    a = torch.linspace(-30, 30, 2001, dtype=torch.float64)
    f = torch.nn.functional
    torch.testing.assert_close(activation_ref("silu", a), f.silu(a))
    torch.testing.assert_close(activation_ref("gelu", a), f.gelu(a, approximate="tanh"))
    torch.testing.assert_close(activation_ref("relu", a), f.relu(a))
    with pytest.raises(ValueError, match="activation must be one of"):
        activation_ref("tanh", a)


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_mlp_ref_matches_nn_linear_layers(act):
    torch.manual_seed(0)
    hidden, inter = 24, 40
    gate = torch.nn.Linear(hidden, inter, bias=False, dtype=torch.float64)
    up = torch.nn.Linear(hidden, inter, bias=False, dtype=torch.float64)
    down = torch.nn.Linear(inter, hidden, bias=False, dtype=torch.float64)
    x = torch.randn(2, 5, hidden, dtype=torch.float64)
    f = torch.nn.functional
    if act == "swiglu":     # Llama's MLP: down(silu(gate(x)) * up(x))
        expected = down(f.silu(gate(x)) * up(x))
        w_gate_up = torch.cat([gate.weight, up.weight])
    else:                   # GPT's MLP: fc2(act(fc1(x)))
        fn = {"gelu": lambda h: f.gelu(h, approximate="tanh"), "silu": f.silu, "relu": f.relu}[act]
        expected = down(fn(gate(x)))
        w_gate_up = gate.weight
    out = mlp_ref(x, w_gate_up, down.weight, act)
    assert out.shape == x.shape
    torch.testing.assert_close(out, expected.detach())


def test_the_oracle_covers_the_kernels_activations():
    from flashflow.ops.mlp import ACTIVATIONS as FUSED

    assert ACTIVATIONS == FUSED
