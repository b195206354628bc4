"""Loading what the SSD drafter's process drafts with (the worker's `make`): a draft model, or the trained head
with the target's frozen parts. The engine (mtptrain/engine/ssd.py) only runs them."""

from __future__ import annotations

from pathlib import Path

from mtptrain.config import TargetConfig
from mtptrain.runtime.linears import product_for, to_product_linears
from mtptrain.engine.draft_model import truncated_target
from mtptrain.engine.ssd import HeadParts
from mtptrain.export.source import load_head_directory
from mtptrain.heads import FrozenTarget
from mtptrain.target import load_frozen_target, load_target


def draft_lm(target: TargetConfig, draft_model: str | None = None, layers: int | None = None,
             device: str = "cpu"):
    """`make` for a draft model in the worker: `draft_model` (a causal LM with the target's tokenizer), or the
    target cut to its first `layers` decoder layers, on `device` (CPU linear layers as eval runs them)."""
    cfg = target.model_copy(update={"device": device, "gpus_per_rank": 1})
    if draft_model is not None:
        cfg = cfg.model_copy(update={"model": draft_model, "gguf_file": None, "revision": None})
    model = load_target(cfg).model
    if layers is not None:
        model = truncated_target(model, layers)
    return _cpu_linears(model, model.config)


def head_parts(directory: str, target: TargetConfig, identity: dict, device: str = "cpu") -> HeadParts:
    """`make` for a head in the worker: the target's embedding, final norm and LM head (its decoder layers
    are not loaded when the checkpoint is in safetensors), and the head, checked against `identity` (the
    target the main process loaded)."""
    cfg = target.model_copy(update={"device": device, "gpus_per_rank": 1})
    loaded = load_frozen_target(cfg) or load_target(cfg)
    head, spec = load_head_directory(Path(directory), FrozenTarget.of(loaded.model), identity)
    head.to(dtype=loaded.model.get_input_embeddings().weight.dtype)
    return HeadParts(_cpu_linears(head, loaded.model.config), spec, loaded.model.config.vocab_size)


def _cpu_linears(model, config):
    """On CPU, the short-input linear layers eval uses (runtime/linears.py), for the life of the worker (it only
    drafts); `config`: the target's, whose shapes the product was measured on."""
    to_product_linears(model, product=product_for("auto", model, config))
    return model
