"""vLLM's `speculators` (0.9.0) as a peer trainer: our feature store in its offline format, and its trained EAGLE-3
checkpoint as a head our engine drafts with.

Its offline data (speculators/train/data.py, data_generation/preprocessing.py):

    <out>/                    a `datasets` directory (save_to_disk): input_ids, loss_mask (int64 [T]), seq_len
    <out>/hidden_states/hs_<i>.safetensors
                              hidden_states [T, K + 1, H]: the K fused layers in order, then the last layer before
                              the final norm (its targets are the verifier's LM head over the verifier's norm of
                              it); token_ids [T], equal to row i's input_ids or the sample is dropped
    <out>/d2t-<N>.npy, t2d-<N>.npy
                              the draft vocabulary it reads for --draft-vocab-size N: ours, so both heads predict
                              over the same tokens

Rows are the store's train split, then its validation split; speculators takes rows [0, N * ratio) for training,
and `train_data_ratio` below makes that exactly our train split. Its loader shifts as ours does (the draft at t
reads the state at t and x_{t+1}, and is scored against the target's distribution at t + 1).

Its checkpoint (speculators/train/checkpointer.py) is a speculators-format directory without our export's
sidecar: the head's settings come from its config.json (eagle_aux_hidden_state_layer_ids are vLLM's ids, ours
+ 1; speculative_tokens is its TTT length), and the target is the one given, whose identity the imported head
records. Our eagle3 head places its norms as speculators does with norm_before_residual and norm_before_fc off;
a checkpoint trained otherwise is refused with the flags to train it with.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from mtptrain.config import TargetConfig
from mtptrain.errors import MtptrainError
from mtptrain.export.formats.eagle3 import eagle3_names, vocab_from_maps, vocab_maps_of
from mtptrain.features.store import FeatureStore, load_manifest
from mtptrain.heads import FrozenTarget
from mtptrain.heads.checkpoint import save_head
from mtptrain.heads.spec import HeadSpec
from mtptrain.heads.vocab import DraftVocab
from mtptrain.io import atomic_write_json, read_json_object
from mtptrain.target import load_identified_parts

log = logging.getLogger(__name__)

SPECULATORS_VERSION = "0.9.0"
DONE = "mtptrain-speculators-data.json"  # written last: the directory is complete
STARTED = "mtptrain-speculators-source.json"  # written first: the store and layers the sample files come from


class PeerError(MtptrainError, ValueError):
    pass


def train_data_ratio(train: int, validation: int) -> float:
    """The ratio whose int(N * ratio) is exactly `train` of N rows (strictly inside (0, 1), as speculators asks)."""
    total = train + validation
    if train == 0 or validation == 0:
        raise PeerError(f"speculators needs both splits: the store has {train} train and {validation} validation "
                        "samples (set data.validation_fraction above 0 and precompute again)")
    return (train + 0.5) / total


def write_offline_data(store_dir: Path, out: Path, feature_layers: list[int], draft_vocab_size: int,
                       show_progress: bool = True) -> dict:
    """Write the store's samples (train split, then validation) in speculators' offline format; returns what
    its trainer needs to be told (rows, ratio, layer ids, vocabulary size). Rerunning rewrites only what is
    missing: each sample file is written whole or not at all."""
    # datasets takes ~1 s to import and is an optional dependency (the `datasets` extra): only this command needs it
    from datasets import Dataset

    out = Path(out)
    last = load_manifest(Path(store_dir))["last_layer"]
    layers = sorted({*feature_layers, last})
    stores = [FeatureStore(store_dir, split, layers=layers, verify="size") for split in ("train", "validation")]
    manifest = stores[0].manifest
    counts = [len(s) for s in stores]
    ratio = train_data_ratio(*counts)
    # the sample files of a killed run are kept, so they must be this store's and these layers'
    made = {"plan_id": manifest["plan_id"], "layers": [*feature_layers, last]}
    marker = out / STARTED
    if marker.is_file() and read_json_object(marker, PeerError, "write to a new directory") != made:
        raise PeerError(f"{out} holds speculators data of another store or other layers ({marker}), left as it "
                        "is: write to a new directory")
    (out / "hidden_states").mkdir(parents=True, exist_ok=True)
    atomic_write_json(marker, made)
    columns: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    row = 0
    progress = tqdm(total=sum(counts), desc="speculators data", unit=" samples", disable=not show_progress)
    for store in stores:
        for i in range(len(store)):
            path = out / "hidden_states" / f"hs_{row}.safetensors"
            ids = store.token_ids(i).long()
            if not path.is_file():
                hidden = store[i]["hidden"]
                states = torch.stack([hidden[j] for j in feature_layers] + [hidden[last]], dim=1)
                tmp = path.with_name(path.name + ".tmp")
                save_file({"hidden_states": states.contiguous(), "token_ids": ids}, str(tmp))
                tmp.replace(path)
            columns["input_ids"].append(ids.numpy())
            columns["loss_mask"].append(store.loss_mask(i).long().numpy())
            columns["seq_len"].append(len(ids))
            row += 1
            progress.update(1)
    progress.close()
    dataset = Dataset.from_dict(columns)
    dataset.set_format("torch")
    dataset.save_to_disk(str(out))
    streams = (stores[0].token_ids(i, assistant_only=True) for i in range(counts[0]))
    vocab = DraftVocab.from_token_streams(streams, draft_vocab_size, manifest["target"]["vocab_size"])
    maps = vocab_maps_of(vocab.draft_to_target, vocab.target_to_draft)
    np.save(out / f"d2t-{draft_vocab_size}.npy", maps["d2t"].numpy())
    np.save(out / f"t2d-{draft_vocab_size}.npy", maps["t2d"].numpy())
    summary = {"store": str(Path(store_dir).resolve()), "rows": row, "train": counts[0], "validation": counts[1],
               "train_data_ratio": ratio, "target_layer_ids": [j + 1 for j in feature_layers],
               "draft_vocab_size": draft_vocab_size, "tokens": int(sum(columns["seq_len"])),
               "hidden_size": manifest["target"]["hidden_size"]}
    atomic_write_json(out / DONE, summary)
    return summary


def import_checkpoint(checkpoint: Path, target_cfg: TargetConfig, out: Path) -> dict:
    """A head directory (as `mtptrain train` writes one) from a speculators EAGLE-3 checkpoint trained for the
    target of `target_cfg`; returns its config."""
    checkpoint = Path(checkpoint)
    config_path = checkpoint / "config.json"
    if not config_path.is_file():
        raise PeerError(f"{config_path} does not exist: point at one of the checkpoint directories speculators "
                        "saved (<save-path>/<epoch>, or its checkpoint_best link)")
    config = read_json_object(config_path, PeerError, "point at a checkpoint directory speculators saved, as it "
                              "saved it")
    if config.get("speculators_model_type") != "eagle3":
        raise PeerError(f"{config_path}: speculators_model_type is {config.get('speculators_model_type')!r}; only "
                        "eagle3 checkpoints are read")
    placed = [flag for flag in ("norm_before_residual", "norm_before_fc") if config.get(flag)]
    if placed:
        raise PeerError(f"{config_path}: trained with {', '.join(placed)}, a norm placement mtptrain's eagle3 head "
                        "does not have; train with --no-norm-before-residual --no-norm-before-fc (and --fc-norm / "
                        "--norm-output as wanted)")
    target, identity = load_identified_parts(target_cfg)
    layer = config["transformer_layer_config"]
    for key in ("hidden_size", "vocab_size"):
        ours = getattr(target.model.config, key)
        if layer.get(key) != ours:
            raise PeerError(f"{config_path}: {key} {layer.get(key)}, but target '{target_cfg.model}' has {ours}: "
                            "give the target the checkpoint was trained for")
    ids = list(config["eagle_aux_hidden_state_layer_ids"])
    proposal = config["speculators_config"]["proposal_methods"][0]
    tensors = load_file(str(checkpoint / "model.safetensors"))
    fc_norms = len(ids) if config.get("fc_norm") else 0
    names = eagle3_names("layers.0.", fc_norms)
    missing = sorted(theirs for theirs in names.values() if theirs not in tensors)
    if missing:
        raise PeerError(f"{checkpoint / 'model.safetensors'} lacks {', '.join(missing[:5])}")
    state = {ours: tensors[theirs] for ours, theirs in names.items()}
    vocab_size = target.model.config.vocab_size
    if "d2t" in tensors:
        state |= vocab_from_maps(tensors["d2t"], vocab_size)
    else:  # trained over the verifier's whole vocabulary: no maps in the file
        state |= {"draft_to_target": torch.arange(vocab_size), "target_to_draft": torch.arange(vocab_size)}
    spec = HeadSpec("eagle3", last_layer=target.num_layers - 1, feature_layers=[i - 1 for i in ids],
                    ttt_steps=int(proposal.get("speculative_tokens", 3)),
                    draft_vocab_size=len(state["draft_to_target"]), fc_norm=bool(config.get("fc_norm")),
                    norm_output=bool(config.get("norm_output")))
    head = spec.family.build(spec, FrozenTarget.of(target.model))
    head.load_state_dict({k: v.to(head.state_dict()[k].dtype) for k, v in state.items()}, strict=True)
    recipe_target = target_cfg.model_dump(mode="json")
    state_file = checkpoint / "training_state.json"
    trained = read_json_object(state_file, PeerError, "point at a checkpoint directory speculators saved, as it "
                               "saved it") if state_file.is_file() else {}
    extra = {"train": {"steps": trained.get("global_step"), "recipe": {"name": "speculators", "target": recipe_target}},
             "imported": {"from": str(checkpoint.resolve()), "trainer": f"speculators {config.get('speculators_version')}",
                          "training_state": trained}}
    save_head(Path(out), head, spec, identity, extra, dtype=tensors["fc.weight"].dtype)
    log.info("imported %s as an mtptrain head in %s (%s)", checkpoint, out, spec)
    return json.loads((Path(out) / "config.json").read_text())
