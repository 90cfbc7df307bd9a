"""Drafters: where candidate tokens come from (see :mod:`specdec.drafters.base`)."""
from specdec.drafters.base import Draft, Drafter, StepContext
from specdec.drafters.callable import CallableDrafter
from specdec.drafters.draft_model import DraftModel
from specdec.drafters.eagle import EagleHead, HeadConfig, HeadNet
from specdec.drafters.multi import MultiDraft
from specdec.drafters.prompt_lookup import PromptLookup
from specdec.drafters.recycling import TokenRecycling
from specdec.drafters.suffix import DocumentDrafter, SuffixDrafter
from specdec.drafters.validate import check_draft, draft_errors

__all__ = ["Draft", "Drafter", "StepContext", "CallableDrafter", "DraftModel", "EagleHead", "HeadNet", "HeadConfig",
           "MultiDraft", "PromptLookup", "SuffixDrafter", "TokenRecycling", "DocumentDrafter", "check_draft",
           "draft_errors"]
