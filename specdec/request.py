"""The request types of the engine: what a caller asks for, what a step returns, and the engine's
own record of a request."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, List, Optional, Tuple

import torch

from specdec._check import as_float, is_int
from specdec.sampling import SamplingParams

__all__ = ["RequestParams", "RequestOutput", "Request", "QueueFull"]


@dataclass(frozen=True)
class RequestParams:
    """Per-request settings. ``temperature == 0`` is greedy (top_k / top_p ignored). ``seed``: a sampled
    request becomes seed-coupled (see :mod:`specdec.engine`): its tokens equal plain seeded sampling
    whatever the drafter and the batch; None: the rejection sampler with a fresh generator.
    ``stop_token_ids``: the request finishes right after emitting any of them."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop_token_ids: Tuple[int, ...] = ()

    def __post_init__(self) -> None:
        m = self.max_new_tokens
        if not is_int(m):
            raise TypeError(f"RequestParams: max_new_tokens must be an int, got {type(m).__name__}")
        if m < 1:
            raise ValueError(f"RequestParams: max_new_tokens must be >= 1, got {m}")
        if self.seed is not None and not is_int(self.seed):
            raise TypeError(f"RequestParams: seed must be an int or None, got {type(self.seed).__name__}")
        try:
            SamplingParams(as_float(self.temperature), self.top_k, as_float(self.top_p))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"RequestParams: {exc}") from None
        stops = self.stop_token_ids
        if is_int(stops):
            stops = (stops,)
        try:
            stops = tuple(stops)
        except TypeError:
            raise TypeError(f"RequestParams: stop_token_ids must be a list of ints, got {type(stops).__name__}") \
                from None
        if not all(is_int(t) for t in stops):
            raise TypeError(f"RequestParams: stop_token_ids must hold ints, got {list(stops)!r}")
        object.__setattr__(self, "stop_token_ids", stops)

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(as_float(self.temperature), self.top_k, as_float(self.top_p))


@dataclass
class RequestOutput:
    """What one step did for one request: the tokens it emitted (in order), and whether it is done."""

    request_id: Hashable
    new_tokens: List[int]
    finished: bool = False
    finish_reason: Optional[str] = None   # "stop" (a stop token), "length" (max_new_tokens), "abort"
    num_generated: int = 0                # tokens generated so far, these included


@dataclass
class Request:
    """The engine's record of one request (waiting or active)."""

    rid: Hashable
    uid: int                        # engine-internal id, given at admission (drafters, scheduler, metrics
                                    # key on it): 0, 1, ... in admission order from the start of a busy period
    prompt: List[int]
    params: RequestParams
    sampling: SamplingParams
    stops: frozenset
    generator: Optional[torch.Generator]   # CPU; None for greedy and seed-coupled requests
    coupled: bool = False                   # seeded engine request: Gumbel-max on (seed, position) noise
    seq: List[int] = field(default_factory=list)
    new: List[int] = field(default_factory=list)
    finish: Optional[str] = None
    t_arrival: float = 0.0
    t_first: Optional[float] = None
    drafted: int = 0
    accepted: int = 0
    passes: int = 0

    def take(self, toks) -> int:
        """Append tokens up to a stop token or ``max_new_tokens`` (then ``finish`` is set); returns how many."""
        n = 0
        limit = self.params.max_new_tokens
        for t in toks:
            self.new.append(t)
            self.seq.append(t)
            n += 1
            if t in self.stops:
                self.finish = "stop"
                break
            if len(self.new) >= limit:
                self.finish = "length"
                break
        return n

    @property
    def context(self) -> List[int]:
        """The tokens whose K/V a cache row holds at (re)admission: the prompt, or for a preempted request
        everything but its last token (the root of its next step)."""
        return self.seq[:-1] if self.new else self.prompt

    @property
    def coupling(self) -> Optional[Tuple[int, int]]:
        """(seed, current length) of a seed-coupled request, else None (see sampling.verify_rows)."""
        return (self.params.seed, len(self.seq)) if self.coupled else None


class QueueFull(RuntimeError):
    """:meth:`Engine.add_request` past ``max_waiting`` waiting requests (a server answers 429)."""
