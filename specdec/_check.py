"""The one validation vocabulary of the Python side.

Every public entry point (constructors, ``generate``, ``add_request``, the server's request
parser) checks what it owns with these helpers, so a bad argument always reads the same way:

    "<owner>: <name> must be <what was expected>, got <what came>"

``owner`` names the component (``"Engine"``, ``"PromptLookup"``, ``"Engine.add_request: request 3"``).
Python's ``bool`` is an ``int`` subclass; none of these accept it where an int is asked for.
Type mismatches raise ``TypeError`` unless ``type_error=False`` (some entry points have always
raised ``ValueError`` for both and keep doing so); range violations raise ``ValueError``.
"""
from __future__ import annotations

from typing import List, Optional

import torch

__all__ = ["is_int", "is_number", "as_float", "check_int", "require_int", "check_number", "non_int_index",
           "out_of_vocab", "check_token_ids", "check_stop_ids"]


def is_int(v) -> bool:
    """True for a Python int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    """True for an int or a float that is not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def as_float(v):
    """An int becomes a float; anything else (a float, None, a wrong type left for the checks) is kept."""
    return float(v) if is_int(v) else v


def _bounds(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f" in [{lo}, {hi}]"
    if lo is not None:
        return f" >= {lo}"
    if hi is not None:
        return f" <= {hi}"
    return ""


def check_int(owner: str, name: str, v, lo: Optional[int] = None, hi: Optional[int] = None,
              allow_none: bool = False, type_error: bool = True) -> Optional[int]:
    """``v`` must be an int (not a bool) within [lo, hi] (either bound optional); returns it.

    Messages: ``"<owner>: <name> must be an int >= <lo>, got <v>"`` (the bounds part as asked)."""
    if v is None and allow_none:
        return None
    what = f"an int{_bounds(lo, hi)}" + (" or None" if allow_none else "")
    if not is_int(v):
        exc = TypeError if type_error else ValueError
        raise exc(f"{owner}: {name} must be {what}, got {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(f"{owner}: {name} must be {what}, got {v!r}")
    return v


def require_int(owner: str, name: str, v, lo: Optional[int] = None, allow_none: bool = False,
                hint: str = "") -> Optional[int]:
    """``v`` must be an int (not a bool), ``>= lo`` when ``lo`` is given; returns it.

    The two-message form of :func:`check_int` that several constructors have always used:
    ``TypeError("<owner>: <name> must be an int, got <type name>")`` (``"an int or None"`` with
    ``allow_none``) and ``ValueError("<owner>: <name> must be >= <lo><hint>, got <v>")``; an empty
    ``owner`` drops the ``"<owner>: "`` prefix."""
    if v is None and allow_none:
        return None
    prefix = f"{owner}: " if owner else ""
    if not is_int(v):
        raise TypeError(f"{prefix}{name} must be an int{' or None' if allow_none else ''}, got {type(v).__name__}")
    if lo is not None and v < lo:
        raise ValueError(f"{prefix}{name} must be >= {lo}{hint}, got {v}")
    return v


def check_number(owner: str, name: str, v, lo: Optional[float] = None, hi: Optional[float] = None,
                 lo_open: bool = False, allow_none: bool = False, type_error: bool = False) -> Optional[float]:
    """``v`` must be an int or float (not a bool) within [lo, hi] (``lo_open``: (lo, hi]); returns a float."""
    if v is None and allow_none:
        return None
    if lo_open and lo is not None:
        what = f"a number > {lo}" + (f" and <= {hi}" if hi is not None else "")
    else:
        what = f"a number{_bounds(lo, hi)}"
    if not is_number(v):
        exc = TypeError if type_error else ValueError
        raise exc(f"{owner}: {name} must be {what}, got {v!r}")
    if lo is not None and (v <= lo if lo_open else v < lo) or (hi is not None and v > hi):
        raise ValueError(f"{owner}: {name} must be {what}, got {v!r}")
    return float(v)


def non_int_index(ids) -> Optional[int]:
    """The index of the first item of ``ids`` that is not an int (bools are not), or None."""
    for j, t in enumerate(ids):
        if not is_int(t):
            return j
    return None


def out_of_vocab(ids, vocab_size: Optional[int]) -> Optional[int]:
    """A token id of ``ids`` outside ``[0, vocab_size)``, or None: the smallest id when one is negative,
    else the largest when it is ``>= vocab_size`` (``vocab_size`` None: only negative ids are out)."""
    if not ids:
        return None
    lo, hi = min(ids), max(ids)
    if lo < 0:
        return lo
    if vocab_size is not None and hi >= vocab_size:
        return hi
    return None


def check_token_ids(where: str, ids, vocab_size: Optional[int] = None, allow_empty: bool = False,
                    what: str = "prompt_ids") -> List[int]:
    """A list / tuple of token ids, or a 1-D integer tensor, as a list of ints.

    ``where`` prefixes every message (it names the component and the request). Raises
    ``TypeError`` for a wrong container or a non-integer token, ``ValueError`` for an empty list
    (unless ``allow_empty``) or an id outside ``[0, vocab_size)``."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"{where}: {what} must be a 1-D integer tensor or a list of ints, got a "
                            f"{ids.dtype} tensor of shape {tuple(ids.shape)}")
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
        raise TypeError(f"{where}: {what} must be a list of token ids, got {type(ids).__name__}")
    j = non_int_index(ids)
    if j is not None:
        raise TypeError(f"{where}: holds a non-integer token {ids[j]!r}")
    if not ids and not allow_empty:
        raise ValueError(f"{where}: empty prompt (at least one token is needed)")
    bad = out_of_vocab(ids, vocab_size) if vocab_size is not None else None
    if bad is not None:
        raise ValueError(f"{where}: holds token id {bad}, outside the vocabulary [0, {vocab_size})")
    return list(ids)


def check_stop_ids(owner: str, name: str, ids) -> frozenset:
    """None, one token id, a tensor or an iterable of token ids, as a frozenset (the ids that end a request)."""
    if ids is None:
        return frozenset()
    if isinstance(ids, torch.Tensor):
        ids = ids.flatten().tolist()
    if is_int(ids):
        return frozenset([ids])
    try:
        items = list(ids)
    except TypeError:
        raise TypeError(f"{owner}: {name} must be an int, a list of ints or None, "
                        f"got {type(ids).__name__}") from None
    if not all(is_int(t) for t in items):
        raise TypeError(f"{owner}: {name} must hold ints, got {items!r}")
    return frozenset(items)
