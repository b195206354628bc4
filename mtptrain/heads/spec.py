"""A head's settings (HeadSpec), and the registry of head families that give them meaning (FAMILIES).

A new family is a module with its head and its HeadFamily (mtptrain/heads/family.py), one line in FAMILIES, and
its kind in mtptrain.config.HeadKind, the recipe's choices.
"""

from __future__ import annotations

from dataclasses import dataclass

from mtptrain.config import HeadConfig, HeadKind, MTPInput, Norms
from mtptrain.errors import MtptrainError
from mtptrain.heads.eagle import EAGLE
from mtptrain.heads.eagle3 import EAGLE3
from mtptrain.heads.family import HeadFamily, HeadSettingsError
from mtptrain.heads.mtp import MTP

FAMILIES: dict[str, HeadFamily] = {family.kind: family for family in (EAGLE, EAGLE3, MTP)}


class UnknownHeadKind(MtptrainError, ValueError):
    pass


def family_of(kind: str) -> HeadFamily:
    try:
        return FAMILIES[kind]
    except KeyError:
        raise UnknownHeadKind(f"unknown head kind {kind!r}: the known kinds are {', '.join(FAMILIES)}") from None


@dataclass(frozen=True)
class HeadSpec:
    """What rebuilds a head: its family and settings, resolved against the feature store it was trained on.

    A head's config.json holds these fields under "head" (dataclasses.asdict); fields the family does not use
    keep their defaults, and a field added later has the default that reads older heads as they were trained.
    """

    kind: HeadKind
    norms: Norms = "restored"
    last_layer: int = -1  # target layer whose states the head reads (eagle, mtp) and is matched to
    feature_layers: tuple[int, ...] = ()  # eagle3: fused layers, low to high
    ttt_steps: int = 1
    draft_vocab_size: int = 0
    fc_norm: bool = False  # eagle3: per-layer norms before fc (EAGLE-3.1)
    norm_output: bool = False  # eagle3: steps read the normed output (EAGLE-3.1)
    mtp_depths: int = 1
    mtp_share: bool = False
    mtp_input: MTPInput = "raw"  # mtp: the target state depth 1 reads; absent in older heads = raw

    def __post_init__(self):
        family_of(self.kind)  # an unknown kind is refused here, with the known ones, not at first use
        object.__setattr__(self, "feature_layers", tuple(self.feature_layers))  # config.json holds a list

    @classmethod
    def of(cls, cfg: HeadConfig, manifest: dict) -> HeadSpec:
        """The spec of the head the recipe's head section trains on the store whose manifest this is."""
        if not family_of(cfg.kind).eagle31_norms and (cfg.fc_norm or cfg.norm_output):
            raise HeadSettingsError(f"head.fc_norm and head.norm_output are EAGLE-3.1 settings of eagle3 heads; "
                                    f"a {cfg.kind} head has no fused layers or TTT steps: leave them false")
        return cls(kind=cfg.kind, norms=cfg.norms, last_layer=manifest["last_layer"],
                   **family_of(cfg.kind).settings(cfg, manifest))

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
