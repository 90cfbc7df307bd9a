"""Starting the ranks of a tensor-parallel target.

* :func:`launch_tensor_parallel`: this process is rank 0; ranks 1.. are spawned here with
  torch.multiprocessing (spawn), all on one machine (loopback rendezvous), gloo on CPU and NCCL when
  ``device="cuda"`` (rank r on GPU r). Returns rank 0's :class:`TensorParallelLM`.
* :func:`init_from_env`: ranks started by ``torchrun`` (one or many machines; MASTER_ADDR /
  MASTER_PORT / RANK / WORLD_SIZE / LOCAL_RANK from the environment). Rank 0 gets the target, every
  other rank runs the worker loop and gets None when rank 0 closes the target.
* :func:`local_tensor_parallel`: the same target code at tensor parallel size 1, in this process.

Every rank loads the whole model (:class:`ModelSource`) and keeps its slice; the control group is
gloo in both cases (the step's command is a CPU byte buffer), the data group NCCL on GPUs.
"""
from __future__ import annotations

import datetime
import os
import socket
import traceback
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from specdec.distributed.comm import Comm, LocalComm
from specdec.distributed.shard import ShardedLlama
from specdec.distributed.target import TensorParallelError, TensorParallelLM, worker_loop

__all__ = ["ModelSource", "launch_tensor_parallel", "init_from_env", "local_tensor_parallel"]

#: how long a rank > 0 waits for rank 0's next command (an idle server sends none)
IDLE_TIMEOUT = datetime.timedelta(days=7)


@dataclass(frozen=True)
class ModelSource:
    """What every rank loads: a bundled model's name (``load_bundled``, with ``precision`` and ``act``)
    or a local Hugging Face folder; ``dtype`` "float32" / "bfloat16" / "float16" (bundled: float32
    weights cast)."""

    name: str = "smollm2-135m"
    precision: str = "fp32"
    dtype: str = "float32"
    act: Optional[str] = None

    def load(self, device: torch.device | str = "cpu") -> torch.nn.Module:
        from specdec.models.bundled import BUNDLED, load_bundled

        dtype = getattr(torch, self.dtype)
        if self.name in BUNDLED:
            model, _ = load_bundled(self.name, dtype=dtype, precision=self.precision, hugepages=False, act=self.act)
        else:
            from specdec.cli import load_hf_folder

            model, _ = load_hf_folder(self.name)
            model = model.to(dtype)
        return model.to(device).eval()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank: int, world_size: int, init_method: str, backend: str, timeout: float,
          delay: Optional[Tuple[float, float]], device) -> Comm:
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout))
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return Comm(None, control, delay=delay, device=device)


def _handshake(comm: Comm, shard: ShardedLlama) -> None:
    """Every rank agrees on the layout (vocabulary, layers); a rank that failed to load is noticed here."""
    mine = torch.tensor([shard.vocab_size, len(shard.layers), shard.head_dim], dtype=torch.int64,
                        device=shard.device)
    lo, hi = mine.clone(), mine.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    if not torch.equal(lo, hi):
        raise TensorParallelError(f"tensor parallel: ranks loaded different models ({lo.tolist()} vs {hi.tolist()})")


def _worker_main(rank: int, world_size: int, init_method: str, backend: str, timeout: float, source: ModelSource,
                 device: str, threads: Optional[int], errors, shared: Optional[torch.nn.Module] = None) -> None:
    try:
        if threads:
            torch.set_num_threads(threads)
        dev = torch.device(f"cuda:{rank}") if device == "cuda" else torch.device("cpu")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        comm = _join(rank, world_size, init_method, backend, timeout, None, dev)
        model = shared if shared is not None else source.load(dev)
        shard = ShardedLlama(model, rank, world_size, comm)
        del model, shared  # the shard holds copies of its slices (and the shared embedding / norms)
        _handshake(comm, shard)
        worker_loop(shard, comm)
    except BaseException:  # noqa: BLE001 - reported to rank 0, then this rank exits non-zero
        errors.put((rank, traceback.format_exc()))
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch_tensor_parallel(source: ModelSource, world_size: int, device: str = "cpu", timeout: float = 120.0,
                           threads: Optional[int] = None, collective_delay: Optional[Tuple[float, float]] = None,
                           model: Optional[torch.nn.Module] = None) -> TensorParallelLM:
    """Rank 0's target over ``world_size`` ranks of this machine (ranks 1.. spawned here).

    ``timeout``: seconds any collective may wait (a lost rank is reported after at most this);
    ``threads``: torch threads of each spawned rank; ``collective_delay``: (fixed seconds, seconds per
    byte) added to each all-reduce on rank 0 (a slower link, for what-if runs); ``model``: rank 0's
    already loaded copy of ``source`` (else it is loaded here). On CPU the spawned ranks read their
    slices from rank 0's copy through shared memory (``model.share_memory()``) instead of loading the
    checkpoint again; on GPUs every rank loads ``source`` onto its own device."""
    import torch.multiprocessing as mp

    if int(world_size) < 1:
        raise ValueError(f"launch_tensor_parallel: world_size must be >= 1, got {world_size}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"launch_tensor_parallel: device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(f"launch_tensor_parallel: {world_size} ranks need {world_size} GPUs, "
                         f"{torch.cuda.device_count()} visible")
    if dist.is_initialized():
        raise RuntimeError("launch_tensor_parallel: this process already belongs to a process group")
    dev = torch.device("cuda:0" if device == "cuda" else "cpu")
    model = source.load(dev) if model is None else model
    if world_size == 1:
        return local_tensor_parallel(model)
    backend = "nccl" if device == "cuda" else "gloo"
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    def make(shared):
        return [ctx.Process(target=_worker_main, daemon=True, args=(r, world_size, init_method, backend, timeout,
                                                                    source, device, threads, errors, shared))
                for r in range(1, world_size)]

    procs = make(model.share_memory() if device == "cpu" else None)
    try:
        procs[0].start()
    except Exception:  # noqa: BLE001 - a model that does not pickle: the ranks load the source themselves
        procs = make(None)
        procs[0].start()
    for p in procs[1:]:
        p.start()

    def stop() -> None:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        if dist.is_initialized():
            dist.destroy_process_group()

    try:
        comm = _join(0, world_size, init_method, backend, timeout, collective_delay, dev)
        shard = ShardedLlama(model, 0, world_size, comm)
        _handshake(comm, shard)
    except Exception as e:
        for p in procs:
            p.join(timeout=2)
        why = [f"rank {r}:\n{tb}" for r, tb in iter(_drain(errors))]
        for p in procs:
            p.terminate()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise TensorParallelError("launch_tensor_parallel: the ranks did not start: " +
                                  ("\n".join(why) if why else f"{type(e).__name__}: {e}")) from e
    return TensorParallelLM(shard, comm, procs, on_close=stop)


def _drain(q):
    out = []
    while not q.empty():
        out.append(q.get())
    return out


def init_from_env(source: ModelSource, device: Optional[str] = None, timeout: float = 120.0,
                  collective_delay: Optional[Tuple[float, float]] = None) -> Optional[TensorParallelLM]:
    """Join ranks started by torchrun (env:// rendezvous). Rank 0 returns the target; any other rank
    serves rank 0 until the target is closed, then returns None."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(f"cuda:{local}") if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    comm = _join(rank, world, "env://", "nccl" if device == "cuda" else "gloo", timeout, collective_delay, dev)
    shard = ShardedLlama(source.load(dev), rank, world, comm)
    _handshake(comm, shard)
    if rank == 0:
        return TensorParallelLM(shard, comm, on_close=dist.destroy_process_group)
    try:
        worker_loop(shard, comm)
    finally:
        dist.destroy_process_group()
    return None


def local_tensor_parallel(model: torch.nn.Module) -> TensorParallelLM:
    """Tensor parallel size 1 in this process: the same shard code, no collectives."""
    comm = LocalComm()
    return TensorParallelLM(ShardedLlama(model, 0, 1, comm), comm)
