"""flashflow.reference.metrics: the error measures every test and bench suite reads."""
import math

import pytest
import torch

from flashflow.reference.metrics import cosine, rel_l1, rel_l2


def test_relative_errors_against_hand_computed_values():
    ref = torch.tensor([3.0, 4.0])
    out = torch.tensor([3.0, 5.0], dtype=torch.float16)
    assert rel_l2(out, ref) == pytest.approx(1 / 5)
    assert rel_l1(out, ref) == pytest.approx(1 / 7)
    assert rel_l2(ref, ref) == rel_l1(ref, ref) == 0.0


def test_cosine_against_hand_computed_values():
    assert cosine(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0])) == pytest.approx(math.sqrt(0.5))
    assert cosine(torch.tensor([2.0, -1.0]), torch.tensor([-4.0, 2.0])) == pytest.approx(-1.0)


@pytest.mark.parametrize("measure", [rel_l2, rel_l1])
def test_an_all_zero_reference_gives_zero_or_inf_never_nan(measure):
    zero = torch.zeros(3)
    assert measure(zero, zero) == 0.0
    assert measure(torch.tensor([0.0, 1e-3, 0.0]), zero) == math.inf


@pytest.mark.parametrize("measure", [rel_l2, rel_l1])
def test_a_nan_output_is_nan(measure):
    assert math.isnan(measure(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0])))
