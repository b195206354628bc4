"""Loading the target in part (training) and split over several devices (precompute and eval of large targets)."""

import errno
import json
import logging
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from conftest import make_tiny_llama, make_tokenizer
from mtptrain.config import TargetConfig, load_recipe
from mtptrain.dist import DistInfo
from mtptrain.io import WriteRefusedError
import mtptrain.target.source as target_source
from mtptrain.target import (
    TargetError, frozen_parameters, identity_mismatch, load_frozen_target, load_identified_parts, load_target,
    model_fingerprint, rank_devices, split_device_map,
)
from mtptrain.target.parts import meta_model

# Llama-3.1-70B-Instruct's config.json, as Meta publishes it (the shapes the 70B recipe is sized for).
LLAMA_31_70B = dict(
    vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
    num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
    tie_word_embeddings=False, bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
    rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"},
)


def _save(directory, tied=True, **save_kwargs):
    tok = make_tokenizer()
    model = make_tiny_llama(len(tok))
    if not tied:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight))
    model.save_pretrained(directory, **save_kwargs)
    tok.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_frozen_parts_equal_the_full_load_and_nothing_else_is_read(tmp_path, tied):
    # Shards of 20 kB put the embedding, the layers and the LM head in different files.
    directory = _save(tmp_path / "t", tied=tied, max_shard_size="20KB")
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    full = load_target(TargetConfig(model=str(directory)))
    names = [name for name, _ in frozen_parameters(full.model)]
    assert ("lm_head.weight" in names) is not tied
    # Only the files holding the frozen tensors are needed: delete every other shard.
    needed = {weight_map[name] for name in names}
    removed = set(weight_map.values()) - needed
    assert removed
    for filename in removed:
        (directory / filename).unlink()
    part = load_frozen_target(TargetConfig(model=str(directory)))

    assert part.partial and not full.partial
    for get in (lambda m: m.get_input_embeddings().weight, lambda m: m.model.norm.weight,
                lambda m: m.get_output_embeddings().weight):
        assert torch.equal(get(part.model), get(full.model))
    assert (part.model.lm_head.weight is part.model.model.embed_tokens.weight) is tied
    assert all(p.device.type == "meta" for p in part.model.model.layers.parameters())
    assert part.frozen_fingerprint == full.frozen_fingerprint
    assert identity_mismatch(full.identity(), part.identity()) is None


def test_a_partial_target_is_refused_for_a_store_of_another_target(tiny_target_dir, other_target_dir):
    full = load_target(TargetConfig(model=str(tiny_target_dir)))
    other = load_frozen_target(TargetConfig(model=str(other_target_dir)))
    assert identity_mismatch(full.identity(), other.identity()) == "frozen_fingerprint"
    # A store from before frozen fingerprints has none to compare: refused, not waved through.
    old = {k: v for k, v in full.identity().items() if k != "frozen_fingerprint"}
    assert identity_mismatch(old, load_frozen_target(TargetConfig(model=str(tiny_target_dir))).identity())


def test_checkpoints_without_the_tensors_in_safetensors_fall_back_to_the_whole_target(tmp_path, caplog):
    directory = _save(tmp_path / "t")
    from safetensors.torch import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    tensors["model.embed_tokens.renamed"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING):
        assert load_frozen_target(TargetConfig(model=str(directory))) is None
    assert "model.embed_tokens.weight" in caplog.text and "loading the whole target" in caplog.text
    (directory / "model.safetensors").unlink()
    assert load_frozen_target(TargetConfig(model=str(directory))) is None


def test_identified_parts_carry_the_whole_targets_identity_with_the_decoder_layers_unread(tmp_path):
    from safetensors.torch import load_file

    directory = _save(tmp_path / "t")
    whole = load_target(TargetConfig(model=str(directory)))
    part, identity = load_identified_parts(TargetConfig(model=str(directory)))
    assert identity == whole.identity() and identity["fingerprint"]
    assert all(t.device.type == "meta" for t in part.model.model.layers.state_dict().values())
    pickled = _save(tmp_path / "bin")  # weights in a pickle, not safetensors: the whole model loads
    torch.save(load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    fallback, fallback_identity = load_identified_parts(TargetConfig(model=str(pickled)))
    assert fallback_identity == load_target(TargetConfig(model=str(pickled))).identity()
    assert not any(t.device.type == "meta" for t in fallback.model.state_dict().values())


@pytest.mark.real_model
def test_embedded_target_loads_in_part_with_the_same_frozen_fingerprint():
    part, full = load_frozen_target(TargetConfig()), load_target(TargetConfig())
    assert part.frozen_fingerprint == full.frozen_fingerprint
    assert identity_mismatch(full.identity(), part.identity()) is None


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_split_device_map_covers_every_weight_in_contiguous_equal_runs(tmp_path, tied):
    directory = _save(tmp_path / "t", tied=tied)
    whole = load_target(TargetConfig(model=str(directory)))
    skeleton = meta_model(whole.config, torch.float32, TargetConfig())
    mapping = split_device_map(skeleton, [torch.device("cuda", 0), torch.device("cuda", 1)])
    assert [mapping[f"model.layers.{i}"] for i in range(4)] == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]
    assert mapping["model.embed_tokens"] == "cuda:0" and mapping["model.norm"] == "cuda:1"
    assert mapping["lm_head"] == ("cuda:0" if tied else "cuda:1")
    for name, _ in skeleton.named_parameters():
        assert any(name.startswith(prefix + ".") for prefix in mapping), name
    # transformers accepts the map as a device_map (all on the CPU here), and the weights load unchanged.
    on_cpu = {name: "cpu" for name in split_device_map(skeleton, [torch.device("cpu")] * 2)}
    placed = AutoModelForCausalLM.from_pretrained(directory, device_map=on_cpu, dtype=torch.float32)
    assert model_fingerprint(placed) == whole.fingerprint


def test_rank_devices_on_cpu_ignore_gpus_per_rank():
    cfg = TargetConfig(gpus_per_rank=2)
    assert rank_devices(cfg, DistInfo(rank=1, world_size=2, local_rank=1)) == [torch.device("cpu")]


def _70b_skeleton():
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA_31_70B), dtype=torch.bfloat16)


def test_70b_recipe_fits_its_gpus():
    """Each precompute rank splits Llama-3.1-70B over target.gpus_per_rank H100s (80 GB): the weights leave
    room for activations, and the node runs gpus_per_node / gpus_per_rank ranks."""
    recipe = load_recipe("recipes/llama-3.1-70b-eagle3.yaml")
    per_rank = recipe.target.gpus_per_rank
    model = _70b_skeleton()
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(70.55e9, rel=1e-3)
    devices = [torch.device("cuda", i) for i in range(per_rank)]
    mapping = split_device_map(model, devices)
    held = dict.fromkeys(map(str, devices), 0)
    for name, param in model.named_parameters():
        prefix = max((p for p in mapping if name.startswith(p + ".")), key=len)
        held[mapping[prefix]] += param.numel() * param.element_size()
    assert max(held.values()) < 72e9, held  # at least 8 GB of each 80 GB GPU left for activations and cache
    assert max(held.values()) / min(held.values()) < 1.01
    for stage in ("precompute", "eval"):
        res = getattr(recipe.slurm, stage)
        assert res.tasks_per_node * per_rank == res.gpus_per_node
    # Training reads only the frozen parts: the embedding and the LM head, 2.1 GB each in bf16.
    frozen = sum(p.numel() * p.element_size() for _, p in frozen_parameters(model))
    assert frozen == pytest.approx(4.2e9, rel=0.01)


@pytest.mark.parametrize("model", ["./models/llama-3-8b", "../llama", "/nonexistent/llama", "~/no-such-model",
                                   "runs/models/llama"])
def test_a_local_path_that_does_not_exist_is_named_at_once(model, tmp_path, monkeypatch):
    import time

    from mtptrain.target import TargetError, load_tokenizer

    monkeypatch.chdir(tmp_path)
    started = time.perf_counter()
    with pytest.raises(TargetError, match="no such directory") as err:
        load_tokenizer(TargetConfig(model=model))
    assert time.perf_counter() - started < 5
    assert model.lstrip("~./") in str(err.value)


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "hub-unreachable"])
def test_a_name_that_could_be_a_hub_id_is_a_missing_directory_when_the_hub_cannot_answer(offline, tmp_path,
                                                                                         monkeypatch):
    """'models/llama' is a directory or a hub id; with the hub out of reach and nothing in its cache, say so now
    (instead of the hub client's retries, 49 s)."""
    import socket
    import time

    from mtptrain.target import TargetError, load_tokenizer

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        with socket.socket() as sock:  # a loopback port nobody listens on
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    started = time.perf_counter()
    with pytest.raises(TargetError, match="no such directory") as err:
        load_tokenizer(TargetConfig(model="models/llama"))
    assert time.perf_counter() - started < 5
    assert ("HF_HUB_OFFLINE" if offline else f"127.0.0.1:{port}") in str(err.value)


def test_a_hub_id_found_in_the_hub_cache_loads_with_the_hub_out_of_reach(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from mtptrain.target import load_tokenizer

    cache = tmp_path / "hub-cache"
    snapshot = cache / "models--org--tiny" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (cache / "models--org--tiny" / "refs").mkdir()
    (cache / "models--org--tiny" / "refs" / "main").write_text("0" * 40)
    make_tokenizer().save_pretrained(snapshot)
    make_tiny_llama(len(make_tokenizer())).config.save_pretrained(snapshot)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert len(load_tokenizer(TargetConfig(model="org/tiny"))) == len(make_tokenizer())


@pytest.mark.parametrize("refusal", ["read-only", "full"])
def test_a_cache_that_refuses_the_converted_gguf_names_its_directory_and_mtptrain_cache(tmp_path, monkeypatch,
                                                                                          refusal):
    """HOME read-only on a fresh machine, or its disk full: tests run as root, so the file system's answer is
    simulated, at the first directory the cache needs or at the conversion's first write."""
    home, mkdir = tmp_path / "home", Path.mkdir
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("MTPTRAIN_CACHE", raising=False)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")

    def read_only(self, *args, **kwargs):
        if self.is_relative_to(home):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return mkdir(self, *args, **kwargs)

    def convert(gguf_path, out):  # what save_pretrained does first: make the directory, then write into it
        out.mkdir(parents=True)
        raise OSError(errno.ENOSPC, "No space left on device")

    if refusal == "read-only":
        monkeypatch.setattr(Path, "mkdir", read_only)
    monkeypatch.setattr(target_source, "_convert_gguf", convert)
    cache = home / ".cache" / "mtptrain" / "targets"
    reason = f"{cache} is read-only. Make it writable" if refusal == "read-only" else \
        f"no space left on {cache}. Free space there"
    with pytest.raises(WriteRefusedError, match=re.escape(
            f"cannot write the safetensors copy of model.gguf (made once, kept in the cache): {reason}, or set "
            "MTPTRAIN_CACHE to a writable directory with room (the cache moves there). Nothing was left "
            "half-written.")):
        target_source.converted_gguf_dir(gguf)
    assert not cache.exists() or not any(cache.iterdir())


def _gguf_header(tensors: int, fields: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, tensors, fields)


HOSTILE_GGUF = {
    "not a GGUF": b"NOPE" * 100,
    "counts past its end": _gguf_header(10**12, 10**12) + bytes(100),
    # one field: an array of arrays, 5,000 deep (60 KB), which a recursive reader follows to its depth
    "arrays nested 5,000 deep": _gguf_header(0, 1) + struct.pack("<Q", 3) + b"key" + struct.pack("<I", 9)
    + struct.pack("<IQ", 9, 1) * 5000 + struct.pack("<IQ", 0, 0),
}


@pytest.mark.parametrize("kind", HOSTILE_GGUF)
def test_a_damaged_or_hostile_gguf_is_refused_naming_it_and_nothing_is_cached(kind, tmp_path, monkeypatch):
    monkeypatch.setenv("MTPTRAIN_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(HOSTILE_GGUF[kind])
    with pytest.raises(TargetError, match=re.escape(f"{gguf} cannot be converted (")) as caught:
        target_source.converted_gguf_dir(gguf)
    assert "download it again, or pass the model's directory as target.model" in str(caught.value)
    targets = tmp_path / "cache" / "targets"
    assert not targets.exists() or not any(targets.iterdir())


@pytest.mark.parametrize("damage", ["header past its limit", "cut off"])
def test_a_damaged_safetensors_file_of_the_target_is_refused_naming_it(tiny_target_dir, tmp_path, damage):
    target = tmp_path / "target"
    shutil.copytree(tiny_target_dir, target)
    weights = target / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(struct.pack("<Q", 2**40) + data[8:] if damage == "header past its limit" else data[:-100])
    cfg = load_recipe(None, [f"target.model={target}"]).target
    with pytest.raises(TargetError, match=r"cannot be read .*download or save the model again"):
        load_target(cfg)
    with pytest.raises(TargetError, match=re.escape(f"{weights} cannot be read as safetensors (")):
        load_frozen_target(cfg)  # training's partial load reads the file itself


@pytest.mark.parametrize("matrices, copy", [
    (["Q8_0", "Q4_0"], torch.bfloat16),  # quantised: a bfloat16 copy, the weights every GPU rounds them to
    (["BF16", "Q8_0"], torch.bfloat16),
    (["Q8_0", "F16"], torch.float32),  # one float16 matrix: float32 keeps its values
    (["F32"], torch.float32),
])
def test_a_gguf_copy_is_bfloat16_unless_a_matrix_is_stored_finer(tmp_path, matrices, copy):
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(tmp_path / "model.gguf", "llama")
    rng = np.random.default_rng(0)
    for i, kind in enumerate(matrices):
        values = rng.standard_normal((8, 64)).astype(np.float32)
        quant = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            writer.add_tensor(f"m{i}", values)
        elif kind == "F16":
            writer.add_tensor(f"m{i}", values.astype(np.float16))
        else:
            writer.add_tensor(f"m{i}", gguf.quants.quantize(values, quant), raw_dtype=quant)
    writer.add_tensor("norm", rng.standard_normal(64).astype(np.float32))  # a vector: float32 in every file
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert target_source.gguf_copy_dtype(tmp_path / "model.gguf") == copy


def test_a_gguf_file_is_parsed_once_while_it_is_converted_and_as_often_as_asked_after(tmp_path):
    """transformers reads the file for the tokenizer, the config and the weights: during a conversion those reads
    share one reader, and the tensor-name map is built once; afterwards, and after a conversion that failed, gguf's
    own names are back."""
    import gguf
    import numpy as np

    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("m", np.ones((8, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    llama = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == "llama")
    with target_source._gguf_parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first and type(first) is reader and first.tensors[0].name == "m"
        assert gguf.GGUFReader(path, "r+") is not first
        assert gguf.get_tensor_name_map(llama, 2) is gguf.get_tensor_name_map(llama, 2)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)
    with pytest.raises(ValueError, match="broken"), target_source._gguf_parsed_once():
        raise ValueError("broken")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)


def test_the_target_is_read_straight_onto_its_device(tiny_target_dir, monkeypatch):
    """from_pretrained gets a device map for one device too: without one it builds the whole model in host memory
    on every rank before `.to(device)` (8 ranks x 16 GB of an 8B target on one node)."""
    import transformers

    calls = []
    original = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    target = load_target(TargetConfig(model=str(tiny_target_dir), device="cpu", dtype="float32"))
    assert calls and calls[0]["device_map"] == {"": "cpu"}
    assert {p.device for p in target.model.parameters()} == {torch.device("cpu")}
