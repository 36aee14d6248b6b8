"""Where this process sits among a data-parallel engine's ranks, and the process group that joins them."""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import logging
import os

import torch
import torch.distributed as dist

from deepinfer_core import envs
from deepinfer_core.engine_args import EngineArgsError

logger = logging.getLogger("deepinfer")


@dataclasses.dataclass(frozen=True)
class RankInfo:
    """This process's rank of ``world_size``, and its index among the ranks of its node (its device)."""

    rank: int
    world_size: int
    local_rank: int


def rank_from_environment() -> RankInfo | None:
    """The rank torch.distributed's ``env://`` rendezvous gives this process (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, as torchrun and ``launcher.py`` set them); None outside a group of more than one."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return RankInfo(rank, world, int(os.environ.get("LOCAL_RANK", rank)))


def check_world_size(info: RankInfo, data_parallel_size: int) -> None:
    """A launcher's world size must be the data-parallel size asked for (1, the default, takes the launcher's)."""
    if data_parallel_size not in (1, info.world_size):
        raise EngineArgsError(f"data_parallel_size={data_parallel_size} but this process is rank {info.rank} of "
                              f"{info.world_size} (WORLD_SIZE); launch as many ranks as data_parallel_size")


def timeout() -> datetime.timedelta:
    """How long a collective (and the parent's wait for a rank) may take: ``DEEPINFER_DISTRIBUTED_TIMEOUT``."""
    return datetime.timedelta(seconds=envs.DEEPINFER_DISTRIBUTED_TIMEOUT)


def join_process_group(info: RankInfo, backend_name: str, device: torch.device) -> None:
    """Join the default process group over ``backend_name`` (the device backend's ``distributed_backend``) with
    ``DEEPINFER_DISTRIBUTED_TIMEOUT`` on every collective; a group already set up by the caller is used as is."""
    if device.type != "cpu":
        torch.get_device_module(device.type).set_device(device)
    if dist.is_initialized():
        if dist.get_world_size() != info.world_size:
            raise EngineArgsError(f"the process group has {dist.get_world_size()} ranks, the engine wants "
                                  f"{info.world_size}")
        return
    dist.init_process_group(backend_name, init_method="env://", rank=info.rank, world_size=info.world_size,
                            timeout=timeout())
    atexit.register(_leave_process_group)  # a group left to interpreter shutdown aborts in gloo's threads
    logger.info("rank %d of %d joined the %s process group", info.rank, info.world_size, backend_name)


def _leave_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def collective_device(backend_name: str, device: torch.device) -> torch.device:
    """Where small collective tensors (flags) live: the host for gloo, the device for nccl / hccl."""
    return torch.device("cpu") if backend_name == "gloo" else device
