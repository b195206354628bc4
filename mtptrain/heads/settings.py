"""A head's settings, the fields of its spec: what a head family reads to build, train and drive its heads
(mtptrain/heads/spec.py: HeadSpec adds the family they belong to)."""

from __future__ import annotations

from dataclasses import dataclass

from mtptrain.config import HeadKind, MTPInput, Norms


@dataclass(frozen=True)
class HeadSettings:
    """A head's config.json holds these fields under "head" (dataclasses.asdict); fields the family does not use
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
