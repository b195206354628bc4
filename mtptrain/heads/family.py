"""A head family (EAGLE, EAGLE-3, MTP, ...) as one object: everything the trainer, the engine, eval and export
need to know about heads of that kind. A family lives in one module beside its head module (eagle.py, eagle3.py,
mtp.py) and is listed once in mtptrain/heads/spec.py: FAMILIES; the rest of the package asks the family of a
head's spec (`spec.family`) and never compares kinds.

    settings        its fields of the head's spec, from the recipe and the feature store; feature_weight: its
                    objective's weight of the feature regression, from the recipe
    build           the head module; draft_vocab: the vocabulary it is built with, where it has its own
    objective       its training objective on one batch (the shared bookkeeping: heads/objective.py)
    draft_positions how many draft positions training scores
    draft_layers    the target layers its drafter reads (SSD hands the drafter process only those)
    chain, tree     the engine's drafters; chain_limit: the longest chain it drafts; no_tree, no_ssd: why it
                    has no tree drafter, or cannot draft for SSD
    reads, facts    what an export's README says of it; export_formats: the formats that can hold it
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, Iterable, NamedTuple

from torch import nn

from mtptrain.config import HeadConfig
from mtptrain.engine.head_chain import HeadChainProposer
from mtptrain.engine.head_tree import HeadTreeProposer
from mtptrain.engine.verify import Sampling
from mtptrain.errors import MtptrainError
from mtptrain.heads.common import FrozenTarget
from mtptrain.heads.losses import Loss
from mtptrain.heads.objective import BatchResult
from mtptrain.heads.settings import HeadSettings
from mtptrain.heads.vocab import DraftVocab

if TYPE_CHECKING:
    from mtptrain.engine.proposer import Proposer


class HeadSettingsError(MtptrainError, ValueError):
    """Head settings of the recipe that the feature store cannot serve; the message names the fix."""


class ChainLimit(NamedTuple):
    """The most tokens one chain of a head drafts, and why (eval notes the K it skips)."""

    tokens: int
    why: str


class HeadFamily(ABC):
    kind: ClassVar[str]  # the recipe's head.kind and the "kind" of a head's config.json
    export_formats: ClassVar[tuple[str, ...]]  # names of mtptrain/export/formats that hold it, preferred first
    # Why the family has no tree drafter, or cannot draft for SSD (for eval's notes); None where it can.
    no_tree: ClassVar[str | None] = "it drafts chains only"
    no_ssd: ClassVar[str | None] = "its drafter cannot pre-draft from the target's states"
    no_int8: ClassVar[str | None] = "its drafter multiplies by the head's own weights only"

    @abstractmethod
    def settings(self, cfg: HeadConfig, manifest: dict) -> dict:
        """The spec's fields this family sets, from the recipe's head section (the family's class of it in
        mtptrain.config.HEAD_CONFIGS) and the feature store's manifest (the others keep HeadSpec's defaults)."""

    def feature_weight(self, cfg: HeadConfig) -> float:
        """The weight `objective` gives a regression of the target's features next to distillation, from the
        recipe's head section; 0 where the family has none."""
        return 0.0

    @abstractmethod
    def build(self, spec: HeadSettings, frozen: FrozenTarget, vocab: DraftVocab | None = None) -> nn.Module:
        """A fresh head (`vocab`: the draft vocabulary, where the family has one; None when rebuilding a saved
        head, whose weights carry it)."""

    def draft_vocab(self, spec: HeadSettings, streams: Iterable[Iterable[int]],
                    target_vocab_size: int) -> DraftVocab | None:
        """The draft vocabulary a new head is built with, from the training data's token streams; None where the
        head drafts over the target's whole vocabulary."""
        return None

    @abstractmethod
    def draft_positions(self, spec: HeadSettings) -> int:
        """Draft positions scored per token in training (steps, depths)."""

    @abstractmethod
    def objective(self, head: nn.Module, batch: dict, spec: HeadSettings, weights: list[float], feature_weight: float,
                  chunk: int, loss: Loss = Loss()) -> BatchResult:
        """The loss of one padded batch (input_ids, loss_mask, hidden: layer -> states), and the statistics of
        every draft position; `loss` is what distillation minimises (heads/losses.py)."""

    @abstractmethod
    def draft_layers(self, spec: HeadSettings) -> list[int]:
        """The target layers whose states the drafter reads while drafting."""

    @abstractmethod
    def chain(self, head: nn.Module, spec: HeadSettings, sampling: Sampling = Sampling(), seed: int = 0,
              stop: float = 0.0, int8: bool = False) -> Proposer:
        """The engine's chain drafter for this head; stop > 0 ends a chain early (eval.chain.stops); int8: from
        int8 copies of its weights (only where `no_int8` is None: eval.draft_weights)."""

    def chain_limit(self, spec: HeadSettings) -> ChainLimit | None:
        """The longest chain the head drafts, where it is bounded; None where it drafts any K."""
        return None

    def tree(self, head: nn.Module, spec: HeadSettings, branch: int, depth: int, budget: int,
             sampling: Sampling = Sampling(), seed: int = 0, children: str = "sampled", int8: bool = False) -> Proposer:
        """The engine's tree drafter for this head (only where `no_tree` is None); `children` at temperature > 0:
        "sampled" (drawn from the head) or "top" (its best tokens)."""
        raise ValueError(f"{self.kind} heads draft no trees: {self.no_tree}")

    def reads(self, spec: HeadSettings) -> str:
        """What the head reads of the target, in words (export READMEs)."""
        return f"reads layer {spec.last_layer} (0-based), the target's last"

    def facts(self, spec: HeadSettings) -> list[str]:
        """README lines on the family's own settings."""
        return []


class EagleStyleFamily(HeadFamily):
    """Heads that draft one token per forward, reading their own predicted feature (EAGLE, EAGLE-3). The head
    chain, EAGLE-2 trees and SSD's head drafter all drive them, through the head's `draft_input`, forward and
    `logits` (mtptrain/engine/head_chain.py)."""

    no_tree = None
    no_ssd = None
    no_int8 = None

    def chain(self, head, spec, sampling=Sampling(), seed=0, stop=0.0, int8=False):
        return HeadChainProposer(head, spec, sampling, seed, stop, int8=int8)

    def tree(self, head, spec, branch, depth, budget, sampling=Sampling(), seed=0, children="sampled", int8=False):
        return HeadTreeProposer(head, spec, branch, depth, budget, sampling, seed, children, int8=int8)
