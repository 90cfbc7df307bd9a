"""The collectives of a tensor-parallel target, timed, and its control channel.

:class:`Comm` wraps one rank's process groups: ``all_reduce`` (the row-parallel sums, on the data
group: NCCL on GPUs, gloo on CPUs) and ``gather`` (the vocab-parallel logits, to rank 0), each
timed so that the collective's share of a step can be reported; ``send`` / ``recv`` carry rank 0's
commands to the other ranks as ONE broadcast of a fixed-size byte buffer on a gloo group (a message
larger than the buffer costs a second broadcast of its tail). ``delay`` models a slower link for
tests and what-if runs: every all-reduce also waits ``fixed + bytes * per_byte`` seconds on rank 0.
"""
from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["Comm", "CommStats", "LocalComm", "MESSAGE_BYTES"]

#: size of the control broadcast; a step's command (tokens, depths, tree mask, journal) fits in it
MESSAGE_BYTES = 64 * 1024
_HEADER = 8


@dataclass
class CommStats:
    """Seconds and bytes of the data collectives since the last :meth:`Comm.take_stats`."""

    seconds: float = 0.0
    bytes: int = 0
    calls: int = 0


class LocalComm:
    """The collectives of a single rank (tensor parallel size 1): nothing to exchange."""

    rank = 0
    world_size = 1

    def __init__(self) -> None:
        self.stats = CommStats()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def gather(self, t: torch.Tensor) -> Optional[List[torch.Tensor]]:
        return [t]

    def take_stats(self) -> CommStats:
        out, self.stats = self.stats, CommStats()
        return out


class Comm(LocalComm):
    """One rank's collectives over torch.distributed (see the module docstring).

    ``group``: the data group (None: the default group); ``control``: the gloo group of the control
    broadcast; ``delay``: (fixed seconds, seconds per byte) added to every all-reduce on rank 0."""

    def __init__(self, group=None, control=None, delay: Optional[Tuple[float, float]] = None,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.group = group
        self.control = control
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.delay = delay
        self.device = torch.device(device)
        self._buf = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)

    def _timed(self, t0: float, nbytes: int) -> None:
        if self.delay is not None and self.rank == 0:
            fixed, per_byte = self.delay
            time.sleep(fixed + per_byte * nbytes)
        self.stats.seconds += time.perf_counter() - t0
        self.stats.bytes += nbytes
        self.stats.calls += 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        dist.all_reduce(t, group=self.group)
        self._timed(t0, t.numel() * t.element_size())
        return t

    def gather(self, t: torch.Tensor) -> Optional[List[torch.Tensor]]:
        """Every rank's ``t`` (same shape on all ranks) on rank 0, None elsewhere."""
        t0 = time.perf_counter()
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(t, parts, dst=dist.get_global_rank(self.group, 0) if self.group is not None else 0,
                    group=self.group)
        self._timed(t0, t.numel() * t.element_size() * (self.world_size - 1))
        return parts

    # ------------------------------------------------------------------ control
    def send(self, message: Any) -> None:
        """Rank 0: broadcast one command (any picklable object of CPU tensors and plain values)."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        n = len(data)
        head = torch.frombuffer(bytearray(n.to_bytes(_HEADER, "little") + data[:MESSAGE_BYTES - _HEADER]),
                                dtype=torch.uint8)
        self._buf[:head.numel()] = head
        dist.broadcast(self._buf, src=0, group=self.control)
        if n > MESSAGE_BYTES - _HEADER:
            tail = torch.frombuffer(bytearray(data[MESSAGE_BYTES - _HEADER:]), dtype=torch.uint8)
            dist.broadcast(tail, src=0, group=self.control)

    def recv(self) -> Any:
        """Ranks > 0: the next command of rank 0 (blocks up to the control group's timeout)."""
        dist.broadcast(self._buf, src=0, group=self.control)
        n = int.from_bytes(bytes(self._buf[:_HEADER].tolist()), "little")
        first = min(n, MESSAGE_BYTES - _HEADER)
        data = self._buf[_HEADER:_HEADER + first].numpy().tobytes()
        if n > first:
            tail = torch.empty(n - first, dtype=torch.uint8)
            dist.broadcast(tail, src=0, group=self.control)
            data += tail.numpy().tobytes()
        return pickle.loads(data)
