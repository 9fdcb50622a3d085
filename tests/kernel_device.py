"""The device of the kernel tests' tensors, defined once: the GPU when one is present and
Triton's interpreter is off, else the CPU (under ``TRITON_INTERPRET=1``). Tests take it as the
``device`` fixture (tests/conftest.py); tables of inputs built at import (the bad-input cases of
tests/ops/test_norm.py, test_joint_norm_rope.py, test_attention_fp8.py) use :data:`DEVICE`."""
import torch

from flashflow.device import interpreting

DEVICE = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
