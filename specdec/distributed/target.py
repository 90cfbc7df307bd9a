"""TensorParallelLM: rank 0's face of a tensor-parallel target, and the loop of the other ranks.

Who decides: rank 0. The Engine (or SpeculativeDecoder), the drafter, the scheduler and the sampler
run on rank 0 only; the other ranks hold their shard of the target and its KV heads and execute what
rank 0 sends. Deciding on every rank from the same seed was the alternative; it is not used because
the decisions are not functions of seeds alone: the goodput scheduler plans from wall-clock costs
(which differ per rank), unseeded requests draw from fresh generators, requests arrive at rank 0's
HTTP server, and a draft model would be recomputed on every rank. Rank 0's logits are the gathered
vocab slices, so every decision is made once, on exact logits.

One broadcast per step: ``forward`` sends ONE control message (:meth:`Comm.send`) holding the call
(tokens, depths, tree mask, kv_offset, the cache rows) and the journal of cache changes since the
previous call -- the previous step's ``commit`` (accepted path and counts: each rank runs
``kv_commit`` on its own shard), row moves, resets -- each with the lengths it saw, plus the current
lengths (so ``cache.lens += 1`` of a plain step needs no message of its own). The K/V never travel.
The collectives inside the forward are two all-reduces per layer and one gather of the logits.

A rank that dies: every call first checks the spawned ranks' processes and the collectives run
under the process group's timeout, so a lost rank surfaces as :class:`TensorParallelError` naming it
(never a hang); the target then refuses further calls.
"""
from __future__ import annotations

import itertools
import time
from typing import Dict, List, Optional, Sequence

import torch

from specdec._check import out_of_vocab
from specdec.cache import StaticKVCache
from specdec.distributed.comm import CommStats
from specdec.distributed.paged import ShardPagedCache, ShardPagedView, lens_of, replay_commit

__all__ = ["TensorParallelLM", "TensorParallelError", "ShardCache", "worker_loop"]


class TensorParallelError(RuntimeError):
    """A rank of a tensor-parallel target died or a collective failed / timed out."""


class ShardCache(StaticKVCache):
    """Rank 0's shard of a tensor-parallel KV cache: its own KV heads, plus a journal of the changes
    the other ranks replay on theirs (sent with the next call): commits and row moves. Changes of the
    lengths alone (``lens += 1``, ``rewind``, ``reset``) need no entry: every message carries them."""

    def _journal(self, op: str, *args) -> None:
        self._tp._journal.append((op, self._cid, self._row0, self.batch, self._base_lens.clone(), args))

    def rows(self, start: int, stop: int) -> "ShardCache":
        plain = super().rows(start, stop)  # a StaticKVCache of views; keep this class and the journal
        view = ShardCache.__new__(ShardCache)
        view.__dict__.update(plain.__dict__)
        view._row0 = self._row0 + start
        return view

    def commit(self, accepted: torch.Tensor, num_accepted: torch.Tensor) -> None:
        self._journal("commit", accepted.cpu(), num_accepted.cpu())
        super().commit(accepted, num_accepted)

    def move_rows(self, moves) -> None:
        """Row moves (``specdec.cache.move_cache_rows``) on every rank's shard."""
        moves = [(int(s), int(d), int(n)) for s, d, n in moves]
        self._journal("move", moves)
        _move_rows(self, moves)


def _move_rows(cache: StaticKVCache, moves) -> None:
    for src, dst, length in moves:
        if src == dst:
            continue
        n = min(length, cache.capacity)
        for t in cache.k + cache.v:
            t[dst, :, :n].copy_(t[src, :, :n])
        cache.lens[dst] = cache.lens[src]


def _replay(caches: Dict[int, StaticKVCache], journal) -> None:
    for op, cid, row0, batch, lens, args in journal:
        base = caches[cid]
        if op == "pcommit":  # a paged shard: the tables and lengths rank 0 saw are in the entry
            replay_commit(base, args)
            continue
        base.lens.copy_(lens)
        view = base.rows(row0, row0 + batch)
        if op == "commit":
            accepted, num = args
            view.commit(accepted.to(base.device), num.to(base.device))
        else:
            _move_rows(view, args[0])


class TensorParallelLM:
    """The target interface (``forward`` / ``forward_last`` / ``prefill`` / ``new_cache``,
    ``vocab_size``, ``device``) over a :class:`~specdec.distributed.shard.ShardedLlama` on every rank;
    this object lives on rank 0. ``procs``: the processes of ranks 1.. when this process spawned them
    (checked before every call); ``on_close``: called by :meth:`close` after the stop message."""

    def __init__(self, shard, comm, procs: Sequence = (), on_close=None, prefill_chunk: int = 512) -> None:
        self.shard = shard
        self.comm = comm
        self.world_size = comm.world_size
        self.procs = list(procs)
        self.on_close = on_close
        self.prefill_chunk = int(prefill_chunk)
        self.vocab_size = shard.vocab_size
        self.device = shard.device
        self.dtype = shard.dtype
        self.num_layers = len(shard.layers)
        self.head_dim = shard.head_dim
        self.num_kv_heads = shard.kv_heads   # rank 0's share (a paged pool's bytes per block are per rank)
        self.supports_paged = True
        self._journal: List = []
        self._caches: Dict[int, ShardCache] = {}
        self._ids = itertools.count()
        self._broken: Optional[str] = None
        self.last_comm = CommStats()   # the collectives of the last forward
        self.last_seconds = 0.0        # the last forward's wall time on rank 0
        self.totals = dict(forwards=0, seconds=0.0, comm_seconds=0.0, comm_bytes=0, messages=0)

    @property
    def calibration_tag(self) -> str:
        """Keeps calibrations (specdec.scheduler.calibrate) apart per tensor-parallel size and link model."""
        return f"tp{self.world_size}|delay={getattr(self.comm, 'delay', None)}"

    def __repr__(self) -> str:
        return f"TensorParallelLM(world_size={self.world_size}, layers={self.num_layers}, vocab={self.vocab_size})"

    # ------------------------------------------------------------------ the wire
    def _check_alive(self) -> None:
        if self._broken:
            raise TensorParallelError(f"TensorParallelLM: unusable after an earlier failure: {self._broken}")
        for r, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                self._fail(f"rank {r} exited (exit code {p.exitcode})")

    def _fail(self, why: str, exc: Optional[BaseException] = None):
        self._broken = why
        raise TensorParallelError(f"TensorParallelLM: {why}; the tensor-parallel target is down "
                                  f"(restart it)") from exc

    def _run(self, message: Optional[dict], fn):
        """Send ``message`` (with the journal and the caches' lengths) to the other ranks, then run ``fn``
        here; a failed collective becomes a TensorParallelError naming the lost rank."""
        self._check_alive()
        try:
            if message is not None and self.world_size > 1:
                message["journal"], self._journal = self._journal, []
                message["lens"] = {cid: c.lens.cpu() for cid, c in self._caches.items()}
                message["tables"] = {cid: c.block_tables.cpu() for cid, c in self._caches.items()
                                     if isinstance(c, ShardPagedCache)}
                self.comm.send(message)
                self.totals["messages"] += 1
            self._journal = [] if self.world_size == 1 else self._journal
            return fn()
        except TensorParallelError:
            raise
        except RuntimeError as e:
            time.sleep(0.2)  # let a dying process be reaped so that the error can name it
            dead = [f"rank {r} (exit code {p.exitcode})" for r, p in enumerate(self.procs, start=1)
                    if p.exitcode is not None]
            self._fail(f"a collective failed ({'lost ' + ', '.join(dead) if dead else type(e).__name__}: {e})", e)

    def _timed(self, fn):
        t0 = time.perf_counter()
        out = fn()
        stats = self.comm.take_stats()
        self.last_comm, self.last_seconds = stats, time.perf_counter() - t0
        tot = self.totals
        tot["forwards"] += 1
        tot["seconds"] += self.last_seconds
        tot["comm_seconds"] += stats.seconds
        tot["comm_bytes"] += stats.bytes
        return out

    # ------------------------------------------------------------------ the target interface
    def new_cache(self, batch: int, capacity: int) -> ShardCache:
        cid = next(self._ids)
        local = self.shard.new_cache(batch, capacity)
        cache = ShardCache.__new__(ShardCache)
        cache.__dict__.update(local.__dict__)
        cache._tp, cache._cid, cache._row0, cache._base_lens = self, cid, 0, cache.lens
        self._run(dict(op="new_cache", cid=cid, batch=int(batch), capacity=int(capacity)), lambda: None)
        self._caches[cid] = cache
        return cache

    def new_paged_cache(self, num_blocks: int, block_size: int = 16, max_requests: int = 8,
                        max_blocks_per_request: Optional[int] = None) -> ShardPagedCache:
        """A paged cache over every rank (specdec.distributed.paged): rank 0 holds the allocator, tables and
        lengths; each rank pools of its KV heads with a scratch page. ``view()`` is what the models read."""
        cid = next(self._ids)
        local = self.shard.new_paged_cache(num_blocks, block_size, max_requests, max_blocks_per_request)
        cache = ShardPagedCache.__new__(ShardPagedCache)
        cache.__dict__.update(local.__dict__)
        cache._tp, cache._cid = self, cid
        self._run(dict(op="new_paged_cache", cid=cid, num_blocks=int(num_blocks), block_size=int(block_size),
                       max_requests=int(max_requests), max_blocks=max_blocks_per_request), lambda: None)
        self._caches[cid] = cache
        return cache

    def _check_call(self, cache, tokens, depths, tree_mask, kv_offset: int) -> None:
        if not isinstance(cache, (ShardCache, ShardPagedView)) or cache._tp is not self:
            raise TypeError(f"TensorParallelLM.forward: cache must come from this target's new_cache() or "
                            f"new_paged_cache().view(), got {type(cache).__name__}")
        if tokens.dim() != 2 or depths.shape != tokens.shape or tokens.shape[0] != cache.batch:
            raise ValueError(f"TensorParallelLM.forward: tokens / depths must be [B={cache.batch}, N], got "
                             f"{tuple(tokens.shape)} / {tuple(depths.shape)}")
        B, N = tokens.shape
        if tree_mask is not None and tuple(tree_mask.shape) != (B, N, kv_offset + N):
            raise ValueError(f"TensorParallelLM.forward: tree_mask must be [{B}, {N}, {kv_offset + N}], got "
                             f"{tuple(tree_mask.shape)}")
        if int(tokens.max()) >= self.vocab_size:
            raise ValueError(f"TensorParallelLM.forward: token {int(tokens.max())} outside [0, {self.vocab_size})")

    def _message(self, cache, tokens, depths, tree_mask, kv_offset, keep) -> dict:
        cpu = (lambda t: None if t is None else t.cpu()) if self.device.type != "cpu" else (lambda t: t)
        return dict(op="forward", cid=cache._cid, row0=cache._row0, batch=cache.batch, tokens=cpu(tokens),
                    depths=cpu(depths), tree_mask=cpu(tree_mask), kv_offset=int(kv_offset),
                    keep=cpu(keep) if isinstance(keep, torch.Tensor) else keep)

    @torch.no_grad()
    def forward(self, cache: ShardCache, tokens: torch.Tensor, depths: torch.Tensor,
                tree_mask: Optional[torch.Tensor] = None, kv_offset: int = 0) -> torch.Tensor:
        """As :meth:`specdec.HFCausalLM.forward`: float32 logits [B, N, V]; cache.lens is not advanced."""
        kv_offset = int(kv_offset)
        self._check_call(cache, tokens, depths, tree_mask, kv_offset)
        if kv_offset and tree_mask is None:
            B, N = tokens.shape
            tree_mask = torch.ones(N, kv_offset + N, dtype=torch.bool, device=tokens.device).tril(kv_offset)
            tree_mask = tree_mask.expand(B, N, kv_offset + N).contiguous()
        msg = self._message(cache, tokens, depths, tree_mask, kv_offset, 0)
        return self._run(msg, lambda: self._timed(
            lambda: self.shard.forward(cache, tokens, depths, tree_mask, kv_offset, 0)))

    __call__ = forward

    @torch.no_grad()
    def forward_last(self, cache: ShardCache, tokens: torch.Tensor, depths: torch.Tensor,
                     last: torch.Tensor) -> torch.Tensor:
        """As :meth:`specdec.HFCausalLM.forward_last`: the logits at node ``last[b]`` of each row, [B, V]."""
        self._check_call(cache, tokens, depths, None, 0)
        keep = torch.as_tensor(last, device=tokens.device).to(torch.long).view(tokens.shape[0], 1)
        msg = self._message(cache, tokens, depths, None, 0, keep)
        return self._run(msg, lambda: self._timed(
            lambda: self.shard.forward(cache, tokens, depths, None, 0, keep)))[:, 0]

    @torch.no_grad()
    def prefill(self, cache: ShardCache, prompts: Sequence[Sequence[int]],
                rows: Optional[Sequence[int]] = None, starts: Optional[Sequence[int]] = None) -> torch.Tensor:
        """As :meth:`specdec.HFCausalLM.prefill` (one prompt at a time, in chunks): float32 [len(prompts), V].
        ``starts[i]``: row ``rows[i]`` already holds that many positions (a cached prefix)."""
        prompts = [[int(t) for t in p] for p in prompts]
        rows = list(range(len(prompts))) if rows is None else [int(r) for r in rows]
        starts = [0] * len(prompts) if starts is None else [int(s) for s in starts]
        if len(rows) != len(prompts) or len(set(rows)) != len(rows) or len(starts) != len(prompts):
            raise ValueError(f"TensorParallelLM.prefill: {len(prompts)} prompts need as many distinct rows and "
                             f"starts, got rows {rows}, starts {starts}")
        for i, (p, r, s0) in enumerate(zip(prompts, rows, starts)):
            if not 0 <= r < cache.batch or not p or s0 < 0 or s0 + len(p) > cache.capacity:
                raise ValueError(f"TensorParallelLM.prefill: prompt {i} ({len(p)} tokens after a start of {s0}) "
                                 f"does not fit row {r} of a cache of {cache.batch} rows x {cache.capacity} "
                                 f"positions")
            bad = out_of_vocab(p, self.vocab_size)
            if bad is not None:
                raise ValueError(f"TensorParallelLM.prefill: prompt {i} holds token {bad}, outside "
                                 f"[0, {self.vocab_size})")
        msg = dict(op="prefill", cid=cache._cid, row0=cache._row0, batch=cache.batch, prompts=prompts, rows=rows,
                   chunk=self.prefill_chunk, starts=starts)
        return self._run(msg, lambda: self._timed(
            lambda: prefill_rows(self.shard, cache, prompts, rows, self.prefill_chunk, starts)))

    def close(self) -> None:
        """Stop the other ranks (they leave their loop) and release the process group."""
        if self.world_size > 1 and not self._broken:
            try:
                self._run(dict(op="stop"), lambda: None)
            except TensorParallelError:
                pass
        self._broken = self._broken or "closed"
        if self.on_close is not None:
            self.on_close()
            self.on_close = None

    def comm_share(self) -> float:
        """The collectives' share of the forwards' wall time on rank 0 since construction."""
        return self.totals["comm_seconds"] / self.totals["seconds"] if self.totals["seconds"] else 0.0


def prefill_rows(shard, cache: StaticKVCache, prompts: List[List[int]], rows: List[int], chunk: int,
                 starts: Optional[List[int]] = None):
    """Every rank: each prompt into its row (after ``starts[i]`` cached positions) in chunks; rank 0 gets the
    logits after each last token."""
    out = []
    for i, (p, r) in enumerate(zip(prompts, rows)):
        view = cache.rows(r, r + 1)
        view.lens.fill_(starts[i] if starts else 0)
        ids = torch.tensor([p], dtype=torch.long, device=shard.device)
        for c0 in range(0, len(p), chunk):
            c1 = min(len(p), c0 + chunk)
            depths = torch.arange(c1 - c0, device=shard.device).view(1, -1)
            last = c1 == len(p)
            logits = shard.forward(view, ids[:, c0:c1], depths, None, 0, 1 if last else 0, head=last)
            view.lens.add_(c1 - c0)
            if last and logits is not None:
                out.append(logits[:, -1])
    return torch.cat(out) if out else None


def worker_loop(shard, comm) -> None:
    """Ranks > 0: execute rank 0's commands until it sends "stop" (or the control group times out)."""
    caches: Dict[int, StaticKVCache] = {}
    while True:
        msg = comm.recv()
        op = msg["op"]
        _replay(caches, msg.get("journal", ()))
        for cid, lens in msg.get("lens", {}).items():
            lens_of(caches[cid]).copy_(lens)
        for cid, tables in msg.get("tables", {}).items():
            caches[cid].block_tables.copy_(tables)
        if op == "stop":
            return
        if op == "new_cache":
            caches[msg["cid"]] = shard.new_cache(msg["batch"], msg["capacity"])
            continue
        if op == "new_paged_cache":
            caches[msg["cid"]] = shard.new_paged_cache(msg["num_blocks"], msg["block_size"], msg["max_requests"],
                                                       msg["max_blocks"])
            continue
        base = caches[msg["cid"]]
        view = base.view(msg["row0"], msg["row0"] + msg["batch"]) if hasattr(base, "allocator") else \
            base.rows(msg["row0"], msg["row0"] + msg["batch"])
        dev = shard.device
        if op == "forward":
            mask = msg["tree_mask"]
            keep = msg["keep"]
            shard.forward(view, msg["tokens"].to(dev), msg["depths"].to(dev),
                          None if mask is None else mask.to(dev), msg["kv_offset"],
                          keep.to(dev) if isinstance(keep, torch.Tensor) else keep)
        elif op == "prefill":
            prefill_rows(shard, view, msg["prompts"], msg["rows"], msg["chunk"], msg.get("starts"))
        else:
            raise RuntimeError(f"tensor parallel rank {comm.rank}: unknown command {op!r}")
