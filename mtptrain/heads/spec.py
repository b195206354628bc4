"""A head's spec (HeadSpec: its settings and their family), and the registry of head families that give the
settings meaning (FAMILIES).

A new family is a module with its head and its HeadFamily (mtptrain/heads/family.py), one line in FAMILIES, its
kind in mtptrain.config.HeadKind, the recipe's choices, and the class of its recipe section in
mtptrain.config.HEAD_CONFIGS.
"""

from __future__ import annotations

from dataclasses import dataclass

from mtptrain.config import HeadConfig
from mtptrain.errors import MtptrainError
from mtptrain.heads.eagle import EAGLE
from mtptrain.heads.eagle3 import EAGLE3
from mtptrain.heads.family import HeadFamily
from mtptrain.heads.mtp import MTP
from mtptrain.heads.settings import HeadSettings

FAMILIES: dict[str, HeadFamily] = {family.kind: family for family in (EAGLE, EAGLE3, MTP)}


class UnknownHeadKind(MtptrainError, ValueError):
    pass


def family_of(kind: str) -> HeadFamily:
    try:
        return FAMILIES[kind]
    except KeyError:
        raise UnknownHeadKind(f"unknown head kind {kind!r}: the known kinds are {', '.join(FAMILIES)}") from None


@dataclass(frozen=True)
class HeadSpec(HeadSettings):
    """What rebuilds a head: its family and settings (mtptrain/heads/settings.py), resolved against the feature
    store it was trained on."""

    def __post_init__(self):
        family_of(self.kind)  # an unknown kind is refused here, with the known ones, not at first use
        object.__setattr__(self, "feature_layers", tuple(self.feature_layers))  # config.json holds a list

    @classmethod
    def of(cls, cfg: HeadConfig, manifest: dict) -> HeadSpec:
        """The spec of the head the recipe's head section trains on the store whose manifest this is."""
        return cls(kind=cfg.kind, last_layer=manifest["last_layer"], **family_of(cfg.kind).settings(cfg, manifest))

    @property
    def family(self) -> HeadFamily:
        return family_of(self.kind)

    @property
    def layers(self) -> list[int]:
        """The target layers the head is trained on and drafts from: the ones a store or a runner captures."""
        return sorted({self.last_layer, *self.feature_layers})

    @property
    def draft_positions(self) -> int:
        return self.family.draft_positions(self)
