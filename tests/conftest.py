import os

import pytest
import torch

# Triton kernels run on the CPU through the interpreter in tests (set before triton is imported).
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
