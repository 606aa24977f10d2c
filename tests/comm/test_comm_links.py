"""One slice over NVLink-class links, the measured slicing elsewhere (taco/comm/links.py).

The decision uses only facts every rank of a group sees alike (its ranks' node by torchrun's
LOCAL_WORLD_SIZE or a world that fits on this node's GPUs, and this GPU's active NVLinks by NVML),
so here those facts are stood in for: no GPU is needed.
"""

from __future__ import annotations

import pytest
import torch

from taco.comm import CommPolicy, links
from taco.comm.policy import default_slices


@pytest.fixture
def node(monkeypatch):
    """A world of 4 ranks on one 8-GPU node whose GPUs have 18 active NVLinks (changeable)."""
    facts = {"nvlinks": 18}
    monkeypatch.setattr(links.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(links.dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(links.dist, "get_process_group_ranks", lambda group: [0, 1, 2, 3])
    monkeypatch.setattr(links.torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(links, "active_nvlinks", lambda index: facts["nvlinks"])
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    links._nvlink_class.cache_clear()
    yield facts
    links._nvlink_class.cache_clear()


def test_one_slice_over_nvlink(node):
    cuda = torch.device("cuda", 0)
    big = 64 << 20
    assert links.nvlink_class(cuda, None)
    assert CommPolicy().slices_for(big, cuda, None) == 1
    assert default_slices(big, device=cuda, group=None) == 1
    assert CommPolicy().slices_for(big) == 4  # no device given: the measured default
    assert CommPolicy().slices_for(big, torch.device("cpu"), None) == 4  # gloo: a slow link


def test_slicing_kept_without_nvlink_or_across_nodes(node, monkeypatch):
    cuda = torch.device("cuda", 0)
    node["nvlinks"] = 0  # PCIe only (or NVML unreadable)
    assert CommPolicy().slices_for(64 << 20, cuda, None) == 4
    node["nvlinks"] = 18
    links._nvlink_class.cache_clear()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun: ranks 0-1 and 2-3 on two nodes
    assert not links.nvlink_class(cuda, None)
    assert links.one_node((2, 3))


def test_nvml_absent_counts_no_links():
    links.active_nvlinks.cache_clear()
    if torch.cuda.is_available():
        pytest.skip("a real GPU: NVML may answer")
    assert links.active_nvlinks(0) == 0
