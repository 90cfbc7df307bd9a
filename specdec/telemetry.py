"""What one engine step measured: the phase clock and the step record.

Every speculative step produces ONE :class:`StepRecord` (who was in the batch, what was drafted,
accepted and emitted, and the step's phase times). The engine's counters, the metrics recorder
(:mod:`specdec.metrics`) and the step policy (:mod:`specdec.scheduler`, which also writes the
trace) all read that record; nothing else is passed between them.

Phases are timed with ``with clock.phase("verify"): ...``. On CPU every op is synchronous and the
clock reads the host wall clock. On CUDA it records events and reads them without synchronising
the stream: a step's own times cover the phases that ended before the step's host sync (marked
with :meth:`PhaseClock.synced`), the totals of every phase are read once, at the end of a call.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, Iterator, List, Tuple

import torch

__all__ = ["PhaseClock", "StepTimes", "StepRecord"]


class PhaseClock:
    """Phase timers: host wall clock on CPU (ops are synchronous); CUDA events on CUDA, read lazily."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._totals: Dict[str, float] = {}
        self._events: List[Tuple[str, object, object]] = []   # CUDA: (phase, start, end) not yet read
        self._step: List[Tuple[str, object, object]] = []     # the current step's phases
        self._settled = 0                                      # of those, how many ended before its host sync

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def add(self, name: str, start, end) -> None:
        """Count ``end - start`` (two marks) towards phase ``name``."""
        if self.cuda:
            self._events.append((name, start, end))
        else:
            self._totals[name] = self._totals.get(name, 0.0) + (end - start)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name`` (of the current step too, see :meth:`begin_step`)."""
        start = self.mark()
        yield
        end = self.mark()
        self.add(name, start, end)
        self._step.append((name, start, end))

    def begin_step(self) -> None:
        self._step = []
        self._settled = 0

    def synced(self) -> None:
        """The host just waited for the device: every phase so far has completed."""
        self._settled = len(self._step)

    def step_seconds(self) -> Dict[str, float]:
        """Seconds per phase of the current step. CUDA: only the phases that ended before :meth:`synced`
        (the later ones are still in flight; they count in :meth:`totals` and the step's wall time)."""
        out: Dict[str, float] = {}
        settled = self._step[:self._settled] if self.cuda else self._step
        for name, s, e in settled:
            out[name] = out.get(name, 0.0) + (s.elapsed_time(e) / 1000.0 if self.cuda else e - s)
        return out

    def totals(self) -> Dict[str, float]:
        """Seconds per phase since the clock was made (CUDA: synchronises once to read the events)."""
        if self.cuda and self._events:
            torch.cuda.synchronize()
            for name, s, e in self._events:
                self._totals[name] = self._totals.get(name, 0.0) + s.elapsed_time(e) / 1000.0
            self._events = []
        return self._totals


@dataclass
class StepTimes:
    """The phase times of one step, in seconds."""

    draft: float
    verify: float
    commit: float
    total: float                 # wall time since the previous step ended (the step's share of the clock)
    catch_up: float = 0.0        # of draft (and total): the drafter catching up, kept out of the per-step costs
    catch_up_positions: int = 0  # positions that catch-up fed (its per-position price is learned)


@dataclass
class StepRecord:
    """One speculative step over the active rows (lists in row order)."""

    request_ids: List[int]       # the engine's id of each row's request
    plan: object                 # the policy's StepPlan for this step
    nodes: int                   # nodes per row the target verified (padded: the same for every row)
    drafted: List[int]           # draft nodes per row, root excluded
    depths: List[int]            # deepest drafted node per row
    accepted: List[int]          # draft tokens accepted per row
    emitted: List[int]           # tokens appended per row (after stop / length truncation)
    times: StepTimes
