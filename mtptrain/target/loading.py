"""Loading the target and its tokenizer: every stage loads the target through `load_target`, whole on this rank's
device or split over several GPUs, or only the parts a head uses (`load_frozen_target`), in the dtype the
runtime picks for it (mtptrain/runtime/dtype.py)."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from torch import nn

from mtptrain.config import TargetConfig
from mtptrain.dist import DistInfo, pick_device
from mtptrain.runtime.dtype import pick_dtype
from mtptrain.target.fingerprint import (
    checkpoint_fingerprint, frozen_fingerprint, model_fingerprint, tokenizer_fingerprint,
)
from mtptrain.target.parts import frozen_modules, frozen_parameters, load_config, meta_model, read_checkpoint_tensors
from mtptrain.target.source import TargetError, load_hint, resolve_local_dir

# transformers (~0.7 s to import) is imported inside the functions that load a model or tokenizer, as in
# mtptrain/target/source.py: a command's checks of its inputs answer before paying for it.

log = logging.getLogger(__name__)


@dataclass
class Target:
    model: nn.Module  # a transformers *ForCausalLM
    tokenizer: object
    name: str
    fingerprint: str | None  # None when only the frozen parts were loaded (`load_frozen_target`)
    tokenizer_fingerprint: str
    frozen_fingerprint: str

    @property
    def partial(self) -> bool:
        """Only the embedding, final norm and LM head hold weights; the decoder layers are on the meta device."""
        return self.fingerprint is None

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def device(self) -> torch.device:
        """Where inputs go: the embedding's device (the first of several when the target is split)."""
        return self.model.get_input_embeddings().weight.device

    def decoder(self) -> nn.Module:
        """The stack without the LM head (embeddings, decoder layers, final norm)."""
        return self.model.get_decoder()

    def decoder_layers(self) -> nn.ModuleList:
        return self.decoder().layers

    def identity(self) -> dict:
        """What a manifest or checkpoint records to recognise this target later."""
        return {
            "name": self.name,
            "fingerprint": self.fingerprint,
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
            "frozen_fingerprint": self.frozen_fingerprint,
            "model_type": self.config.model_type,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "num_layers": self.num_layers,
        }


def pick_attention(requested: str, device: torch.device) -> str:
    if requested != "auto":
        return requested
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def load_tokenizer(cfg: TargetConfig):
    from transformers import AutoTokenizer  # lazy: see the note after the imports

    source, _ = resolve_local_dir(cfg)
    try:
        return AutoTokenizer.from_pretrained(source, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    except (OSError, RecursionError) as exc:
        raise TargetError(load_hint(cfg.model, exc)) from exc


def load_target(cfg: TargetConfig, dist: DistInfo | None = None) -> Target:
    """The whole target on this rank's device, or split over its `target.gpus_per_rank` GPUs."""
    from transformers import AutoModelForCausalLM  # lazy: see the note after the imports

    dist = dist or DistInfo()
    source, name = resolve_local_dir(cfg)
    devices = rank_devices(cfg, dist)
    config = load_config(cfg, source)
    dtype = pick_dtype(cfg.dtype, devices[0], config)
    attention = pick_attention(cfg.attn_implementation, devices[0])
    tokenizer = load_tokenizer(cfg)
    # Every weight is read straight onto its device: without a device map, from_pretrained builds the whole model
    # in host memory first (8 ranks of a node x 16 GB for an 8B target) and `.to(device)` copies it after.
    if len(devices) > 1:
        device_map = split_device_map(meta_model(config, dtype, cfg), devices)
    else:
        device_map = {"": str(devices[0])}
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source,
            revision=cfg.revision,
            dtype=dtype,
            attn_implementation=attention,
            trust_remote_code=cfg.trust_remote_code,
            device_map=device_map,
        )
    except (OSError, RecursionError, SafetensorError) as exc:
        raise TargetError(load_hint(cfg.model, exc)) from exc
    model.eval().requires_grad_(False)
    log.info("target %s: %d layers, hidden %d, vocab %d, %s on %s, attention %s",
             name, model.config.num_hidden_layers, model.config.hidden_size, model.config.vocab_size,
             str(dtype).removeprefix("torch."), ", ".join(map(str, devices)), attention)
    return Target(model, tokenizer, name, model_fingerprint(model), tokenizer_fingerprint(tokenizer),
                  frozen_fingerprint(model))


def load_frozen_target(cfg: TargetConfig, dist: DistInfo | None = None) -> Target | None:
    """The target with only its embedding, final norm and LM head read from the checkpoint, on this rank's
    device; the decoder layers stay on the meta device. That is all training a head needs: a rank holds
    2 × 128,256 × 8,192 bf16 values of Llama-3.1-70B (4.2 GB) instead of its 141 GB.

    Returns None when the checkpoint is not in safetensors files that name those tensors as the model
    does (the caller then loads the whole target).
    """
    dist = dist or DistInfo()
    source, name = resolve_local_dir(cfg)
    device = pick_device(cfg.device, dist)
    config = load_config(cfg, source)
    dtype = pick_dtype(cfg.dtype, device, config)  # the dtype the whole target loads in: its parts must equal it
    tokenizer = load_tokenizer(cfg)
    model = meta_model(config, dtype, cfg)
    tensors = read_checkpoint_tensors(source, cfg, [param_name for param_name, _ in frozen_parameters(model)])
    if tensors is None:
        return None
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    with torch.no_grad():
        for module in frozen_modules(model):
            module.to_empty(device=device)
        for param_name, param in model.named_parameters():
            if param_name in tensors:
                param.copy_(tensors[param_name])
        if tied:
            model.get_output_embeddings().weight = model.get_input_embeddings().weight
    model.eval().requires_grad_(False)
    log.info("target %s: embedding, final norm and LM head (%s) on %s; decoder layers not loaded",
             name, str(dtype).removeprefix("torch."), device)
    return Target(model, tokenizer, name, None, tokenizer_fingerprint(tokenizer), frozen_fingerprint(model))


def load_identified_parts(cfg: TargetConfig) -> tuple[Target, dict]:
    """The target as a head needs it, with the identity a head records: its frozen parts and the fingerprint of
    every weight read from the safetensors files one tensor at a time, or the whole model where its files do
    not allow that (then the identity is the loaded model's)."""
    frozen = load_frozen_target(cfg)
    fingerprint = checkpoint_fingerprint(cfg) if frozen is not None else None
    if fingerprint is None:
        whole = load_target(cfg)
        return whole, whole.identity()
    return frozen, {**frozen.identity(), "fingerprint": fingerprint}


def rank_devices(cfg: TargetConfig, dist: DistInfo) -> list[torch.device]:
    """The devices this rank's copy of the target spans: `target.gpus_per_rank` consecutive GPUs on CUDA
    (from local_rank × N, or from the index of an explicit `target.device`), else one device."""
    first = pick_device(cfg.device, dist)
    count = cfg.gpus_per_rank
    if count == 1 or first.type != "cuda":
        if count > 1:
            log.info("target.gpus_per_rank=%d applies to CUDA only: the target loads whole on %s", count, first)
        return [first]
    start = dist.local_rank * count if cfg.device == "auto" else (first.index or 0)
    visible = torch.cuda.device_count()
    if start + count > visible:
        raise TargetError(
            f"local rank {dist.local_rank} needs GPUs {start}..{start + count - 1} for target.gpus_per_rank="
            f"{count}, but {visible} are visible: run at most {visible // count} rank(s) per node "
            f"(slurm.<stage>.tasks_per_node), or lower target.gpus_per_rank")
    return [torch.device("cuda", start + i) for i in range(count)]


def split_device_map(model: nn.Module, devices: list[torch.device]) -> dict[str, str]:
    """A `device_map` that cuts the decoder layers into len(devices) contiguous runs of equal size.

    The embedding and rotary embedding go with the first run, the final norm and the LM head with the
    last (the LM head stays with the embedding when they are tied). Layers run one device after the
    other; transformers moves each layer's inputs to its device.
    """
    names = {id(module): module_name for module_name, module in model.named_modules()}
    decoder = model.get_decoder()
    prefix = names[id(decoder)]
    layers = decoder.layers
    first, last = str(devices[0]), str(devices[-1])
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    mapping: dict[str, str] = {}
    for child_name, child in decoder.named_children():
        if child is layers:
            for i in range(len(layers)):
                mapping[f"{prefix}.layers.{i}"] = str(devices[i * len(devices) // len(layers)])
        else:
            mapping[f"{prefix}.{child_name}"] = last if child is decoder.norm else first
    for child_name, child in model.named_children():
        if child is not decoder:
            mapping[child_name] = first if (tied and child is model.get_output_embeddings()) else last
    return mapping
