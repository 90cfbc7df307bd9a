"""Drafters: where candidate tokens come from (see :mod:`specdec.drafters.base`)."""
from specdec.drafters.base import CallableDrafter, Draft, Drafter, StepContext
from specdec.drafters.draft_model import DraftModel
from specdec.drafters.prompt_lookup import PromptLookup
from specdec.drafters.recycling import TokenRecycling
from specdec.drafters.suffix import DocumentDrafter, SuffixDrafter

__all__ = ["Draft", "Drafter", "StepContext", "CallableDrafter", "DraftModel", "PromptLookup",
           "SuffixDrafter", "TokenRecycling", "DocumentDrafter"]
