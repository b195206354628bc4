"""Fingerprints of the target, and the comparison of two target identities.

They let later stages refuse inputs made for another model: the target
fingerprint covers the architecture config and a sample of every weight
tensor; the tokenizer fingerprint covers the vocabulary, the special tokens
and the chat template.
"""

from __future__ import annotations

import hashlib
import json
from typing import Callable

import torch
from torch import nn

from mtptrain.config import TargetConfig
from mtptrain.target.parts import (checkpoint_file, checkpoint_weight_map, frozen_parameters, load_config, meta_model,
                                   open_checkpoint_file)
from mtptrain.target.source import resolve_local_dir

# Config keys that describe how a model was loaded or saved, not what it computes.
_VOLATILE_CONFIG_KEYS = {
    "_name_or_path", "name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "quantization_config", "_attn_implementation", "_attn_implementation_autoset", "attn_implementation",
    "_commit_hash", "architectures", "auto_map", "output_hidden_states", "output_attentions",
}
_SAMPLES_PER_TENSOR = 4096

ARCHITECTURE_FIELDS = ("model_type", "hidden_size", "vocab_size", "num_layers")


def compared_fields(given: dict) -> list[str]:
    """The identity fields two targets are compared on: the whole-weights fingerprint when `given` has one, else
    the frozen parts' (a target loaded in part); the tokenizer's; the architecture's."""
    weights = "fingerprint" if given.get("fingerprint") is not None else "frozen_fingerprint"
    return [weights, "tokenizer_fingerprint", *ARCHITECTURE_FIELDS]


def identity_mismatch(stored: dict, given: dict) -> str | None:
    """The first identity field that differs between two target identities, or None when they match.

    A target loaded in part (`load_frozen_target`) is compared on its frozen parts: the embedding, final
    norm and LM head, with the architecture config, are what a head trained on stored features uses. The
    architecture fields are compared where both identities record them.
    """
    for key in compared_fields(given):
        if key in ARCHITECTURE_FIELDS and (key not in stored or key not in given):
            continue
        if stored.get(key) != given.get(key):
            return key
    return None


def config_fingerprint_dict(config) -> dict:
    return {k: v for k, v in sorted(config.to_dict().items()) if k not in _VOLATILE_CONFIG_KEYS}


def _digest_parameters(config, names: list[str], tensor: Callable[[str], torch.Tensor]) -> str:
    """Digest of the architecture config and an evenly strided sample of each named tensor.

    Samples are rounded to bfloat16 first, so a float32 and a bfloat16 load of
    the same checkpoint share a fingerprint. Sampling keeps this cheap for
    70B targets while any retrained or swapped tensor still changes it.
    `tensor(name)` is called once per name, in sorted order, so a caller can
    read the tensors one at a time.
    """
    digest = hashlib.sha256()
    digest.update(json.dumps(config_fingerprint_dict(config), sort_keys=True, default=str).encode())
    for name in sorted(names):
        param = tensor(name)
        flat = param.detach().reshape(-1)
        step = max(1, flat.numel() // _SAMPLES_PER_TENSOR)
        sample = flat[::step].to("cpu", torch.bfloat16).view(torch.int16).numpy().tobytes()
        digest.update(f"{name}:{tuple(param.shape)}:".encode())
        digest.update(sample)
    return digest.hexdigest()[:32]


def _digest_modules(config, parameters) -> str:
    named = dict(parameters)
    return _digest_parameters(config, list(named), named.__getitem__)


@torch.no_grad()
def model_fingerprint(model: nn.Module) -> str:
    """The target's fingerprint: its config and a sample of every weight."""
    return _digest_modules(model.config, model.named_parameters())


@torch.no_grad()
def frozen_fingerprint(model: nn.Module) -> str:
    """The fingerprint of what a head uses of the target: its config, embedding, final norm and LM head."""
    return _digest_modules(model.config, frozen_parameters(model))


def checkpoint_fingerprint(cfg: TargetConfig) -> str | None:
    """`model_fingerprint` of the target, read from its safetensors files one tensor at a time instead of
    building the model: what a partly loaded target (`load_frozen_target`) checks a recorded fingerprint
    with. None when the files do not name every parameter as the model does (then only a whole load tells).
    """
    source, _ = resolve_local_dir(cfg)
    config = load_config(cfg, source)
    names = [name for name, _ in meta_model(config, torch.float32, cfg).named_parameters()]
    weight_map = checkpoint_weight_map(source, cfg)
    if weight_map is None or any(name not in weight_map for name in names):
        return None
    handles = {}
    try:
        def tensor(name: str) -> torch.Tensor:
            file = weight_map[name]
            if file not in handles:
                handles[file] = open_checkpoint_file(checkpoint_file(source, file, cfg))
            return handles[file].get_tensor(name)

        return _digest_parameters(config, names, tensor)
    finally:
        handles.clear()


def tokenizer_fingerprint(tokenizer) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    digest.update((tokenizer.chat_template or "").encode() if isinstance(tokenizer.chat_template, str)
                  else json.dumps(tokenizer.chat_template, sort_keys=True).encode())
    return digest.hexdigest()[:32]
