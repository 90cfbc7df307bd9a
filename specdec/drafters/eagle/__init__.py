"""Feature draft heads (EAGLE-style): :class:`EagleHead` (the drafter), :class:`HeadNet` / :class:`HeadConfig`
(the weights), training (:mod:`.train`) and checkpoint loading (:mod:`.checkpoint`)."""
from specdec.drafters.eagle.checkpoint import load_head, save_head
from specdec.drafters.eagle.drafter import EagleHead
from specdec.drafters.eagle.net import HeadConfig, HeadNet

__all__ = ["EagleHead", "HeadNet", "HeadConfig", "load_head", "save_head"]
