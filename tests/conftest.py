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
    """`tests.helpers.corpus.TEXT` prepared as a text data set (BPE, vocab 300): (text path, cache dir)."""
    from taco.train.data import prepare_text
    from tests.helpers.corpus import TEXT

    d = tmp_path_factory.mktemp("corpus")
    (d / "play.txt").write_text(TEXT)
    prepare_text(d / "play.txt", d / "cache", vocab_size=300, progress=lambda *a: None)
    return d / "play.txt", d / "cache"



@pytest.fixture
def legacy_int_defaults(monkeypatch):
    """Tests of wire layouts and kernels written against the intB-hadamard settings before the
    measured defaults (`tests.helpers.legacy_defaults`), for codecs built in this process; rank bodies
    call `tests.helpers.legacy_defaults.pin()` themselves. The defaults are tested in
    tests/codec/test_codec_defaults.py."""
    from tests.helpers.legacy_defaults import LEGACY_INT_DEFAULTS, classes

    for cls in classes():
        monkeypatch.setattr(cls, "DEFAULTS", dict(LEGACY_INT_DEFAULTS))
