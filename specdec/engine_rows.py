"""The Engine's request rows: admission (prefill from a cached prefix, the first token), emission,
preemption and retirement. A mixin of :class:`specdec.engine.Engine` (it reads the engine's
``target``, ``drafter``, ``kv``, ``cache``, ``recorder``, ``scheduler`` and row state); split out
to keep each file about one thing. docs/serving.md describes the lifecycle.
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from specdec.metrics import MetricsRecorder
from specdec.request import Request, RequestOutput
from specdec.sampling import SamplingParams, verify_rows
from specdec.tree import TokenTree

__all__ = ["EngineRows"]


class EngineRows:
    """Row lifecycle methods of the Engine (see the module docstring)."""

    def _emit(self, req: Request, toks: Sequence[int], deltas: Dict[int, RequestOutput]) -> Tuple[int, bool]:
        """Append tokens up to a stop token / max_new_tokens; returns (count appended, finished)."""
        n = req.take(toks)
        done = req.finish is not None
        if n:
            d = deltas.get(req.uid)
            if d is None:
                d = deltas[req.uid] = RequestOutput(req.rid, [])
            d.new_tokens.extend(req.new[len(req.new) - n:])
            d.num_generated = len(req.new)
            if done:
                d.finished = True
                d.finish_reason = req.finish
            self.counters["generated_tokens"] += n
        return n, done

    def _verify(self, tree: TokenTree, logits: torch.Tensor, q: Optional[torch.Tensor], reqs: Sequence[Request]):
        """Accept per row under each row's own setting (:func:`specdec.sampling.verify_rows`)."""
        return verify_rows(tree, logits, q, [r.sampling for r in reqs], [r.coupling for r in reqs],
                           [r.generator for r in reqs], self.max_nodes)

    def _step_params(self) -> SamplingParams:
        first = self._rows[0].sampling
        return first if all(r.sampling == first for r in self._rows) else SamplingParams()

    def _admit(self, deltas, finished: List[int]) -> None:
        """Waiting requests that get a row (and, paged, their blocks) are prefilled (from their cached
        prefix); a new request draws its first token, a preempted one resumes at its last token."""
        b0 = len(self._rows)
        new: List[Request] = []
        starts: List[int] = []
        while self._waiting and b0 + len(new) < self.max_batch:
            req = self._waiting[0]
            start = self.kv.admit(req.rid, b0 + len(new), req.context, b0 + len(new))
            if start is None:  # the pool lacks the blocks: wait for rows to finish (FCFS)
                break
            new.append(self._waiting.popleft())
            starts.append(start)
        if not new:
            return
        if b0 == 0:  # a busy period starts: ids from 0 (the request index of a generate call), fresh metrics
            self._uid = 0
            if self._auto_recorder:
                self.recorder = MetricsRecorder(0, self.device)
        for req in new:
            req.uid = self._uid
            self._uid += 1
        rows = list(range(b0, b0 + len(new)))
        ctx = [req.context for req in new]
        clock = self.recorder.clock
        with clock.phase("prefill"):
            try:
                if any(starts):
                    logits0 = self.target.prefill(self.cache, [c[s:] for c, s in zip(ctx, starts)], rows=rows,
                                                  starts=starts)
                else:
                    logits0 = self.target.prefill(self.cache, ctx, rows=rows)   # [n, V]
            except Exception:
                for r in reversed(new):
                    self.kv.release(r.rid)
                    self._waiting.appendleft(r)
                raise
            fresh = [i for i, req in enumerate(new) if not req.new]
            roots = [req.seq[-1] for req in new]
            if fresh:
                reqs = [new[i] for i in fresh]
                root_tree = TokenTree.root_only(torch.zeros(len(fresh), dtype=torch.int64, device=self.device))
                pick = torch.tensor(fresh, dtype=torch.long, device=logits0.device)
                _, _, out0 = self._verify(root_tree, logits0.index_select(0, pick).float().view(len(fresh), 1, -1),
                                          None, reqs)
                for i, t in zip(fresh, out0[:, 0].tolist()):   # host sync: the first token of each request
                    roots[i] = t
        now = time.perf_counter()
        self._rows.extend(new)
        self._roots = torch.cat([self._roots, torch.tensor(roots, dtype=torch.int64, device=self.device)])
        for i in fresh:
            new[i].t_first = now
            _, done = self._emit(new[i], [roots[i]], deltas)
            if done:
                finished.append(rows[i])
        if self.drafter is not None:
            with clock.phase("draft_prefill"):
                if b0 == 0:
                    self.drafter.start([req.seq[:-1] for req in self._rows], self._step_params(),
                                       self.draft_generator)
                else:
                    self.drafter.admit(rows, ctx)
        for req, c in zip(new, ctx):   # key the prefilled full blocks for later requests
            self.kv.register(req.rid, c)

    def _make_room(self) -> None:
        """Paged: every active row holds blocks for its committed positions and the next tree; when the pool
        runs short the latest-arrived request is preempted (its blocks freed, re-queued first, recomputed
        at readmission: vLLM's recompute preemption)."""
        while self._rows and not self.kv.reserve([(r.rid, len(r.seq) - 1) for r in self._rows]):
            if len(self._rows) == 1:
                raise RuntimeError(f"{self.name}: the KV pool cannot hold one request ({len(self._rows[0].seq)} "
                                   f"positions); this is a bug: the pool is sized for max_len")
            victim = max(range(len(self._rows)), key=lambda r: self._rows[r].t_arrival)
            self._retire([victim], requeue=True)

    # ------------------------------------------------------------------ rows
    def _forget(self, req: Request) -> None:
        self._by_id.pop(req.rid, None)
        self.lazy_verify.forget(req.uid)
        if req.uid >= 0:
            self.scheduler.requests.pop(req.uid, None)
        if req.finish != "abort":
            self.counters["requests_finished"] += 1

    def _retire(self, gone_rows: List[int], requeue: bool = False) -> None:
        """Drop rows (finished / aborted, or preempted with ``requeue``): their KV is released and the last
        active rows move into the holes (target cache, drafter state, roots)."""
        b = len(self._rows)
        gone = set(gone_rows)
        for r in sorted(gone, reverse=True):
            req = self._rows[r]
            self.kv.release(req.rid)
            if requeue:
                self.scheduler.requests.pop(req.uid, None)
                req.uid = -1
                self._waiting.appendleft(req)
                self.counters["preemptions"] += 1
            else:
                self._forget(req)
        keep = [r for r in range(b) if r not in gone]
        b_new = len(keep)
        holes = [r for r in range(b_new) if r in gone]
        tail = [r for r in range(b_new, b) if r not in gone]
        moves = [(src, dst, len(self._rows[src].seq)) for src, dst in zip(tail, holes)]
        perm = list(range(b_new))
        rows = list(self._rows)
        for src, dst, _ in moves:
            perm[dst] = src
            rows[dst] = rows[src]
        self.kv.move(moves, [self._rows[src].rid for src, _, _ in moves])
        self._rows = rows[:b_new]
        if self.drafter is not None:
            self.drafter.retire(moves, b_new)
        if b_new == 0:
            self._roots = self._roots[:0]
        elif moves:
            self._roots = self._roots.index_select(0, torch.tensor(perm, dtype=torch.int64, device=self.device))
        else:
            self._roots = self._roots[:b_new]
