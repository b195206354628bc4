"""Eval's drafting methods, one object per name of eval.methods, listed once in METHODS.

A method says what it drafts with (`head`: eval.head, loaded once for every method that needs it, whose
proposers read the head's layers of the target; `draft_model`: eval.draft, a draft model or the target cut to
its first layers), refuses the settings it cannot run with (`check`), and builds its configurations: one per K
of eval.k (trees: one per budget of eval.tree.budgets), each making a fresh proposer on demand. A new method is
one class here, one line in METHODS and its name in mtptrain.config.EvalMethodName, the recipe's choices.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar

import torch

from mtptrain.config import Recipe, TargetConfig
from mtptrain.engine.draft_model import DraftModelProposer, truncated_target
from mtptrain.engine.ngram import NgramProposer
from mtptrain.engine.ssd import SSDProposer, SSDSettings
from mtptrain.engine.suffix_index import SuffixIndexProposer
from mtptrain.engine.verify import Sampling
from mtptrain.errors import MtptrainError
from mtptrain.eval.drafters import draft_lm, head_parts
from mtptrain.export.source import load_head_directory
from mtptrain.heads import FrozenTarget
from mtptrain.heads.checkpoint import head_directory
from mtptrain.heads.spec import HeadSpec
from mtptrain.runtime.runner import runtime_for
from mtptrain.target import load_target, load_tokenizer


class EvalError(MtptrainError, ValueError):
    pass


@dataclass
class Config:
    """One measured configuration: a method with its draft length (or tree budget)."""

    label: str
    method: str  # baseline, or a name of METHODS
    k: int = 0  # draft length; a tree's depth
    budget: int | None = None  # tree nodes
    make: Callable[[], object] | None = None  # a fresh proposer (None: the baseline)
    uses_head: bool = False
    threads: int | None = None  # the target's CPU threads while this runs (ssd: the drafter has the others)
    keeps_proposer: bool = False  # one proposer for warm-up and measurement (ssd: a worker process each)


@dataclass(frozen=True)
class HeadInfo:
    """The head the run drafts with: where it was loaded from, its spec, its size."""

    path: Path
    spec: HeadSpec
    parameters: int

    def record(self) -> dict:
        """results.json's "head"."""
        spec = self.spec
        return {"path": str(self.path), "kind": spec.kind, "norms": spec.norms, "last_layer": spec.last_layer,
                "feature_layers": list(spec.feature_layers), "parameters": self.parameters}


@dataclass
class Drafting:
    """What the methods build their configurations from, and what they leave besides them: notes on what they
    skipped, and the drafting modules (head, draft model) that run beside the target."""

    recipe: Recipe
    target: object  # the loaded target (mtptrain.target.load_target)
    sampling: Sampling
    seed: int  # the drafters' own stream, apart from the engine's
    head: torch.nn.Module | None = None
    head_info: HeadInfo | None = None
    notes: list[str] = field(default_factory=list)
    modules: list = field(default_factory=list)

    @property
    def spec(self) -> HeadSpec:
        return self.head_info.spec


class EvalMethod(ABC):
    name: ClassVar[str]  # its name in eval.methods, and the "method" of its configurations in results.json
    head: ClassVar[bool] = False  # drafts with eval.head, reading the head's layers of the target
    draft_model: ClassVar[bool] = False  # drafts with eval.draft: a draft model, or the target cut short

    def check(self, recipe: Recipe, target) -> None:
        """Refuses settings the method cannot run with (an EvalError naming the setting and the fix)."""
        if self.draft_model:
            _check_draft_choice(recipe.eval)
            if recipe.eval.draft.model is not None:
                _check_draft_tokenizer(recipe, target)

    @abstractmethod
    def configs(self, drafting: Drafting) -> list[Config]:
        """Its configurations, in the order they are measured (a note in drafting.notes for any it skips)."""

    def per_k(self, ks: list[int], make: Callable[[], object]) -> list[Config]:
        """A configuration "<name> K=<k>" per draft length, each making its proposer with `make`."""
        return [Config(f"{self.name} K={k}", self.name, k, make=make, uses_head=self.head) for k in ks]


class Ngram(EvalMethod):
    """Prompt lookup: what followed the latest earlier match of the last n tokens (eval.ngram)."""

    name = "ngram"

    def configs(self, drafting):
        ev = drafting.recipe.eval
        return self.per_k(ev.k, functools.partial(NgramProposer, ev.ngram.min, ev.ngram.max))


class Suffix(EvalMethod):
    """The most frequent continuation in an index over past outputs."""

    name = "suffix"

    def configs(self, drafting):
        return self.per_k(drafting.recipe.eval.k, SuffixIndexProposer)


class Chain(EvalMethod):
    """The head's chain drafter (its family's), for every K up to the longest chain the head drafts."""

    name = "chain"
    head = True

    def configs(self, drafting):
        ks, spec = drafting.recipe.eval.k, drafting.spec
        limit = spec.family.chain_limit(spec)
        drafted = [k for k in ks if limit is None or k <= limit.tokens]
        if len(drafted) < len(ks):
            drafting.notes.append(f"chain: {limit.why}; K > {limit.tokens} skipped")
        make = functools.partial(spec.family.chain, drafting.head, spec, drafting.sampling, drafting.seed)
        return self.per_k(drafted, make)


class Tree(EvalMethod):
    """EAGLE-2 trees from the head's family's tree drafter, per node budget of eval.tree.budgets."""

    name = "tree"
    head = True

    def configs(self, drafting):
        tree, spec = drafting.recipe.eval.tree, drafting.spec
        if spec.family.no_tree:
            drafting.notes.append(f"tree: {spec.family.no_tree}")
            return []
        return [Config(f"tree N={budget}", self.name, tree.depth, budget, functools.partial(
                    spec.family.tree, drafting.head, spec, tree.branch, tree.depth, budget, drafting.sampling,
                    drafting.seed), uses_head=True)
                for budget in tree.budgets]


class Draft(EvalMethod):
    """A draft model in this process, verified like any chain."""

    name = "draft"
    draft_model = True

    def configs(self, drafting):
        model = _draft_model(drafting.recipe, drafting.target)
        source = runtime_for(model)  # its decoder, read once for every proposer of the run
        if source is model:  # transformers' forward: its linear layers take eval's product
            drafting.modules.append(model)
        make = functools.partial(DraftModelProposer, source, drafting.sampling, drafting.seed)
        return self.per_k(drafting.recipe.eval.k, make)


class SSDMethod(EvalMethod):
    """SSD for each K: a drafter process per configuration, started once and kept for the run; on a CPU the
    target keeps the threads the drafter does not take."""

    @abstractmethod
    def drafter(self, drafting: Drafting, device: str) -> tuple[Callable, list[int] | None]:
        """The worker's `make` on `device`, and the target layers it reads (None: none)."""

    def configs(self, drafting):
        ev, target = drafting.recipe.eval, drafting.target
        make_drafter, layers = self.drafter(drafting, ssd_device(ev.ssd.device, target.device))
        threads = max(1, torch.get_num_threads() - ev.ssd.threads) if target.device.type == "cpu" else None
        configs = []
        for k in ev.k:
            settings = SSDSettings(k=k, budget=ev.ssd.budget, factor=ev.ssd.factor, fallback=ev.ssd.fallback,
                                   threads=ev.ssd.threads, sampling=drafting.sampling, seed=drafting.seed)
            make = functools.partial(SSDProposer, make_drafter, settings, layers, target.device)
            configs.append(Config(f"{self.name} K={k}", self.name, k, make=make, uses_head=self.head,
                                  threads=threads, keeps_proposer=True))
        return configs


class SSD(SSDMethod):
    """SSD with the head, which the worker rebuilds from the states of the target layers it reads."""

    name = "ssd"
    head = True

    def configs(self, drafting):
        if drafting.spec.family.no_ssd:
            drafting.notes.append(f"ssd: {drafting.spec.family.no_ssd}")
            return []
        return super().configs(drafting)

    def drafter(self, drafting, device):
        spec, recipe = drafting.spec, drafting.recipe
        make = functools.partial(head_parts, str(drafting.head_info.path), recipe.target, drafting.target.identity(),
                                 device)
        return make, spec.family.draft_layers(spec)


class SSDDraft(SSDMethod):
    """SSD with the draft model of eval.draft."""

    name = "ssd-draft"
    draft_model = True

    def drafter(self, drafting, device):
        recipe = drafting.recipe
        return functools.partial(draft_lm, recipe.target, recipe.eval.draft.model, recipe.eval.draft.layers,
                                 device), None


METHODS: dict[str, EvalMethod] = {m.name: m for m in (Ngram(), Suffix(), Chain(), Tree(), Draft(), SSD(),
                                                       SSDDraft())}


def method_of(name: str) -> EvalMethod:
    try:
        return METHODS[name]
    except KeyError:
        raise EvalError(f"unknown eval method {name!r}: the known methods are {', '.join(METHODS)}") from None


def build_configs(recipe: Recipe, target, sampling: Sampling) -> tuple[list[Config], HeadInfo | None, list[str], list]:
    """The baseline and every (method, K / budget) of the recipe; the head's description; notes on skips;
    the drafting modules (head, draft model) besides the target."""
    methods = [method_of(name) for name in recipe.eval.methods]
    drafting = Drafting(recipe, target, sampling, seed=recipe.eval.seed + 7919)
    if any(method.head for method in methods):
        drafting.head, drafting.head_info = _load_head(recipe, target)
        drafting.modules.append(drafting.head)
    configs = [Config("baseline", "baseline")]
    for method in methods:
        method.check(recipe, target)
        configs += method.configs(drafting)
    return configs, drafting.head_info, drafting.notes, drafting.modules


def ssd_device(choice: str, target_device: torch.device) -> str:
    """The SSD drafter's device: eval.ssd.device, or (auto) a GPU other than the target's when there is one."""
    if choice != "auto":
        return choice
    if target_device.type != "cuda":
        return "cpu"
    count = torch.cuda.device_count()
    index = target_device.index or 0
    return f"cuda:{(index + 1) % count}" if count > 1 else f"cuda:{index}"


def _load_head(recipe: Recipe, target) -> tuple[torch.nn.Module, HeadInfo]:
    directory = head_directory(recipe)
    if not (directory / "config.json").is_file():
        named = [name for name, method in METHODS.items() if method.head]
        raise EvalError(f"no trained head at {directory} (eval.methods has {', '.join(named)}, which draft with "
                        "a head): run `mtptrain train` with this recipe first, point eval.head at a head "
                        f"directory, or drop {'/'.join(named)} from mtptrain.eval.methods")
    head, spec = load_head_directory(directory, FrozenTarget.of(target.model), target.identity())
    head.to(dtype=next(target.model.parameters()).dtype)
    return head, HeadInfo(directory, spec, sum(p.numel() for p in head.parameters()))


def _draft_model(recipe: Recipe, target):
    """The draft model of eval.draft (checked by EvalMethod.check): the target cut short, or a model loaded."""
    ev = recipe.eval
    if ev.draft.layers is not None:
        return truncated_target(target.model, ev.draft.layers)
    cfg = recipe.target.model_copy(update={"model": ev.draft.model, "gguf_file": None, "revision": None})
    return load_target(TargetConfig(**cfg.model_dump())).model


def _check_draft_tokenizer(recipe: Recipe, target) -> None:
    ev = recipe.eval
    cfg = recipe.target.model_copy(update={"model": ev.draft.model, "gguf_file": None, "revision": None})
    if load_tokenizer(cfg).get_vocab() != target.tokenizer.get_vocab():
        raise EvalError(f"eval.draft.model {ev.draft.model} has another tokenizer than the target: a draft model must "
                        "share the target's vocabulary token for token")


def _check_draft_choice(ev) -> None:
    if (ev.draft.model is None) == (ev.draft.layers is None):
        raise EvalError("eval.methods has 'draft' or 'ssd-draft': set exactly one of eval.draft.model (a causal LM "
                        "with the target's tokenizer) or eval.draft.layers (the target cut to its first N layers)")
