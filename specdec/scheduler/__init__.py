"""Scheduler: how much to speculate, per step and per request, from measured costs and acceptance.

The decoding loop asks its policy for a plan before every step (:meth:`Policy.plan`: the draft
depth each active row may use) and reports the step's outcome after its host sync
(:meth:`Policy.observe`). Policies: ``"fixed"`` (the drafter's own depth), ``"heuristic"``
(transformers' +2 / -1 schedule) and ``"goodput"`` (the default: the depth that maximises expected
tokens per second, with fallback to plain decoding where speculation does not pay).

Modules: :mod:`~specdec.scheduler.acceptance` (acceptance statistics), :mod:`~specdec.scheduler.cost`
(the cost model), :mod:`~specdec.scheduler.calibrate` (seeding it with timed forwards),
:mod:`~specdec.scheduler.policies` (the policy interface, fixed and heuristic),
:mod:`~specdec.scheduler.goodput` (the goodput policy). docs/scheduler.md explains the design.

Plans read only host statistics of earlier steps, never the current step's random draws, so every
policy keeps greedy output equal to the target's and sampled output distributed as the target's.
"""
from specdec.scheduler.acceptance import AcceptanceStats
from specdec.scheduler.calibrate import calibrate, calibration_key, calibration_path
from specdec.scheduler.cost import CostModel, CostTable
from specdec.scheduler.goodput import GoodputPolicy
from specdec.scheduler.policies import (CHECK, FALLBACK, POLICIES, PROBE, SPEC, FixedPolicy, HeuristicPolicy, Policy,
                                        RequestRecord, StepPlan, StepTimes, drafter_shape, make_policy)
from specdec.tree import expected_tokens, expected_tokens_chain, expected_tokens_tree, plan_tree

__all__ = ["CostModel", "AcceptanceStats", "Policy", "FixedPolicy", "HeuristicPolicy", "GoodputPolicy",
           "StepPlan", "StepTimes", "POLICIES", "make_policy", "expected_tokens", "expected_tokens_chain",
           "expected_tokens_tree", "plan_tree", "calibrate", "calibration_key",
           "CostTable", "RequestRecord", "drafter_shape", "calibration_path", "SPEC", "FALLBACK", "PROBE", "CHECK"]
