import os

import pytest
import torch

# Triton kernels run on the CPU through the interpreter in tests (set before triton is imported).
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """`tests.corpus.TEXT` prepared as a text data set (BPE, vocab 300): (text path, cache dir)."""
    from taco.train.data import prepare_text
    from tests.corpus import TEXT

    d = tmp_path_factory.mktemp("corpus")
    (d / "play.txt").write_text(TEXT)
    prepare_text(d / "play.txt", d / "cache", vocab_size=300, progress=lambda *a: None)
    return d / "play.txt", d / "cache"
