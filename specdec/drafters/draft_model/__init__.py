"""The draft-model drafter: a smaller LM of the target's vocabulary drafts chains and trees.

:mod:`.model` holds :class:`DraftModel` (binding, draft cache, accept); :mod:`.spine`, :mod:`.dynamic`
and :mod:`.planned` the three tree builders, each returning a :class:`~.proposal.Proposal`;
:mod:`.cache` the draft cache's feeding, catch-up and rollback; :mod:`.learners` the two online
learners. docs/drafters.md, "The draft model", explains the design.
"""
from specdec.drafters.draft_model.learners import GREEDY_RANK_ACCEPT, PLAN_EVERY
from specdec.drafters.draft_model.model import DraftModel
from specdec.drafters.draft_model.planned import SAMPLED_RANK_ACCEPT
from specdec.drafters.draft_model.proposal import Proposal

__all__ = ["DraftModel", "Proposal", "GREEDY_RANK_ACCEPT", "SAMPLED_RANK_ACCEPT", "PLAN_EVERY"]
