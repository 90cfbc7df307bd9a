"""Past one device: a tensor-parallel target over torch.distributed, and Ray Serve replicas.

* :class:`~specdec.distributed.shard.ShardedLlama`: one rank's slice of a Llama-style decoder
  (column-parallel q / k / v / gate / up, row-parallel o / down with one all-reduce each,
  vocab-parallel LM head gathered on rank 0), run with specdec's ops on its own KV heads.
* :class:`~specdec.distributed.target.TensorParallelLM`: rank 0's target object (the interface the
  Engine drives); the other ranks run :func:`~specdec.distributed.target.worker_loop`.
* :func:`~specdec.distributed.launch.launch_tensor_parallel`: spawns the ranks with
  torch.multiprocessing (gloo on CPU, NCCL on GPUs); :func:`~specdec.distributed.launch.init_from_env`
  joins ranks started by torchrun.
* :mod:`specdec.distributed.ray_serve`: ``specdec serve`` replicas behind one Ray Serve endpoint
  (the ``ray`` extra).

docs/distributed.md has the design, the launch recipes and the cost model.
"""
from specdec.distributed.comm import Comm, CommStats, LocalComm
from specdec.distributed.launch import ModelSource, init_from_env, launch_tensor_parallel, local_tensor_parallel
from specdec.distributed.shard import ShardedLlama
from specdec.distributed.target import ShardCache, TensorParallelError, TensorParallelLM, worker_loop

__all__ = ["Comm", "CommStats", "LocalComm", "ModelSource", "ShardCache", "ShardedLlama", "TensorParallelError",
           "TensorParallelLM", "init_from_env", "launch_tensor_parallel", "local_tensor_parallel", "worker_loop"]
