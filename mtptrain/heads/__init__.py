"""Draft heads: plain nn.Modules shared by the trainer and the inference engine."""

from mtptrain.heads.common import FrozenTarget
from mtptrain.heads.eagle import EagleHead
from mtptrain.heads.mtp import MTPHead

__all__ = ["EagleHead", "FrozenTarget", "MTPHead"]
