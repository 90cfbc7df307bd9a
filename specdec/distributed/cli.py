"""``--tensor-parallel N`` of ``specdec generate`` / ``specdec serve``: the target on N ranks.

Started by hand (``specdec serve --tensor-parallel 2``), this process is rank 0 and spawns the other
ranks (:func:`specdec.distributed.launch.launch_tensor_parallel`: gloo on CPU, NCCL on GPUs).
Started by ``torchrun`` (RANK / WORLD_SIZE in the environment, WORLD_SIZE == N), every process
joins through env:// (:func:`~specdec.distributed.launch.init_from_env`); rank 0 goes on to serve,
the other ranks execute rank 0's commands and exit when it closes.
"""
from __future__ import annotations

import atexit
import os
import sys
from typing import Optional

import torch

from specdec.distributed.launch import ModelSource, init_from_env, launch_tensor_parallel

__all__ = ["tensor_parallel_target", "under_torchrun"]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def tensor_parallel_target(name: str, world_size: int, model: Optional[torch.nn.Module] = None,
                           threads: Optional[int] = None, timeout: float = 300.0, precision: str = "fp32",
                           act: Optional[str] = None):
    """Rank 0's TensorParallelLM of the bundled model ``name`` (at ``precision`` / ``act``, as every rank
    loads it) or a Hugging Face folder, closed at exit. Under torchrun a rank other than 0 serves rank 0
    here and then exits the process."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    source = ModelSource(name, precision=precision, act=act)
    if under_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world_size:
            raise ValueError(f"--tensor-parallel {world_size} under torchrun with WORLD_SIZE="
                             f"{os.environ['WORLD_SIZE']}: they must agree")
        target = init_from_env(source, device=device, timeout=timeout)
        if target is None:  # a worker rank: rank 0 closed the target
            sys.exit(0)
    else:
        target = launch_tensor_parallel(source, world_size, device=device, timeout=timeout, threads=threads,
                                        model=model)
    atexit.register(target.close)
    return target
