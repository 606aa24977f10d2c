"""Which class of link a communicator's ranks share: how many slices a compressed all-reduce uses.

Why this file exists: slicing (docs/design.md 1.3) overlaps the coding of one slice with the transfer
of another. That pays where the transfer is long (PCIe, InfiniBand, Ethernet); on NVLink-class links
(hundreds of GB/s per GPU) a slice's transfer is shorter than the launches and host work each extra
slice costs, so there a message goes as one slice. The slice count must be the same on every rank of
the group (it decides which collectives run), so it is decided from facts each rank sees alike,
without communicating: the group's ranks all on this node (torchrun's LOCAL_WORLD_SIZE, or a world
no larger than this node's GPUs), and this node's GPU with active NVLinks (NVML; a node's GPUs are
one model, so every rank of an intra-node group answers the same). Anything unknown (no NVML, ranks
on other nodes, CPU tensors) counts as a slow link, where slicing is the measured best.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch
import torch.distributed as dist

NVML_MAX_LINKS = 18
"""NVLinks per GPU that NVML reports at most (18 on Hopper)"""


@functools.lru_cache(maxsize=16)
def active_nvlinks(index: int) -> int:
    """Active NVLinks of CUDA device `index` by NVML (0 when NVML or the device cannot be read)."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return 0
        uuid = f"GPU-{torch.cuda.get_device_properties(index).uuid}".encode()
    except (OSError, AttributeError, RuntimeError, AssertionError):
        return 0
    handle = ctypes.c_void_p()
    if nvml.nvmlDeviceGetHandleByUUID(uuid, ctypes.byref(handle)) != 0:
        return 0
    active = 0
    for link in range(NVML_MAX_LINKS):
        state = ctypes.c_int(0)  # nvmlEnableState_t: 1 = active
        if nvml.nvmlDeviceGetNvLinkState(handle, link, ctypes.byref(state)) == 0 and state.value == 1:
            active += 1
    return active


def one_node(ranks: tuple[int, ...]) -> bool:
    """Whether these global ranks share a node: by torchrun's LOCAL_WORLD_SIZE (nodes of equal size,
    ranks numbered node by node), else when the whole world fits on this node's GPUs."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is not None and local.isdigit() and int(local) > 0:
        return len({r // int(local) for r in ranks}) == 1
    return dist.get_world_size() <= torch.cuda.device_count()


@functools.lru_cache(maxsize=64)
def _nvlink_class(index: int, ranks: tuple[int, ...]) -> bool:
    return one_node(ranks) and active_nvlinks(index) > 0


def nvlink_class(device: torch.device, group: dist.ProcessGroup | None) -> bool:
    """Whether `group`'s ranks talk over NVLink-class links from this CUDA `device` (module docstring)."""
    if device.type != "cuda" or not dist.is_initialized():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _nvlink_class(index, tuple(dist.get_process_group_ranks(group or dist.group.WORLD)))
