"""`mtptrain train`: fit a draft head on a feature store with DeepSpeed.

DeepSpeed owns the optimizer (AdamW), the warmup + cosine schedule, ZeRO,
precision, accumulation and clipping, all from one config generated from the
recipe and saved with the run. Its checkpoints (every `checkpoint_every`
steps and at the end, with its `latest` pointer) carry the trainer's own
state: the global micro-batch position and the RNG states, so a resumed run
continues exactly where the last checkpoint stood. DeepSpeed writes them as
torch pickles; they are read back only from this run's own directory, when
their files match the record the run wrote beside them, and with
`weights_only=True` (train/checkpoints.py).

Stopping on request. A file named STOP in the run directory (what the Slurm
train job writes on its time-limit or preemption warning) makes every rank
checkpoint at the next optimizer step and return; the trainer then leaves a
REQUEUE file there with the step and checkpoint, and the job requeues itself.
Running the same command again resumes from that checkpoint.

The head module itself knows nothing of this: the loss comes from the
objective of the head's family (mtptrain/heads/family.py), through the head's
own forward code.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib
import json
import logging
import os
import shutil
import socket
import time
from contextlib import nullcontext
from pathlib import Path

import deepspeed
import torch
import torch.distributed as torch_dist
from tqdm import tqdm

from mtptrain.config import Recipe, dump_recipe, flat_head
from mtptrain.dist import DistInfo, destroy_process_group, from_main, pick_device, slurm_rendezvous
from mtptrain.errors import MtptrainError
from mtptrain.export.run import export_head
from mtptrain.export.sidecar import ExportError
from mtptrain.features.online import ONLINE, OnlineFeatures, prepare_online
from mtptrain.features.stores import FeatureStores, combined_manifest, features_runtime, open_stores, store_dirs
from mtptrain.heads import FrozenTarget
from mtptrain.heads.checkpoint import save_head
from mtptrain.heads.losses import Loss
from mtptrain.heads.objective import step_weights
from mtptrain.heads.spec import HeadSpec
from mtptrain.heads.vocab import DraftVocab
from mtptrain.data.chat import stop_tokens
from mtptrain.io import atomic_write_json, load_json
from mtptrain.memory_plan import check_plan, gpu_memory_gib, summary
from mtptrain.runtime.dtype import agree_on_dtype, ranks_must_agree
from mtptrain.runtime.runner import runtime_for, runtime_record
from mtptrain.target import (
    ARCHITECTURE_FIELDS, Target, checkpoint_fingerprint, compared_fields, load_config, load_frozen_target, load_target,
    rank_devices,
)
from mtptrain.train.averaging import WeightAverage
from mtptrain.train.checkpoints import commit, latest_tag, load, restore_rng, rng_state, tag_for, verify
from mtptrain.train.checkpoints import RunMismatch  # noqa: F401 (verify raises it; callers catch it here)
from mtptrain.train.data import BatchPlan, loader, steps_for
from mtptrain.train.drafting import BestHead, drafting_metrics
from mtptrain.train.metrics import MetricsLog
from mtptrain.train.optimization import autocast, deepspeed_config, pick_precision, trained_parameters
from mtptrain.train.scoring import Window, nonfinite, score_store, to_device

log = logging.getLogger(__name__)


class TrainingDiverged(MtptrainError, RuntimeError):
    pass


STOP_FILE = "STOP"  # in the run directory: checkpoint at the next step and stop
REQUEUE_FILE = "REQUEUE"  # left by a run that stopped on request: where it stopped


# train fields added after checkpoints were written, with their defaults: at the default they stay out of the
# fingerprint, so that those checkpoints still resume
LATER_FIELDS = {"reachable": False, "ema_decay": None, "topk_loss": 0, "topk_loss_weight": 1.0}


def run_fingerprint(recipe: Recipe, manifest: dict, world_size: int) -> str:
    """What a checkpoint must share with the run resuming it (not logging or checkpoint cadence, nor the padding of
    micro-batches, which changes no sample and no loss; W&B settings live in the recipe's tracking section, which
    is not part of it). The head section enters in the flat layout (mtptrain.config.flat_head), the one the
    fingerprints of checkpoints already written were taken of."""
    train = recipe.train.model_dump(exclude={"output_dir", "log_every", "eval_every", "checkpoint_every",
                                              "num_workers", "pad_multiple", "head_dtype", "head_snapshots",
                                              "target_check", "engine_eval"})
    for field, default in LATER_FIELDS.items():  # absent from the fingerprints of checkpoints written before them
        if train.get(field) == default:
            train.pop(field)
    blob = json.dumps({"head": flat_head(recipe.head), "train": train, "store": manifest["plan_id"],
                       "world_size": world_size}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _launcher_env(dist: DistInfo) -> None:
    """DeepSpeed reads RANK / WORLD_SIZE / MASTER_*: torchrun and the deepspeed launcher set them; srun
    tasks get them from the Slurm step; a plain single process gets a loopback rendezvous."""
    slurm = slurm_rendezvous(dict(os.environ)) if "MASTER_ADDR" not in os.environ else None
    if slurm is not None and dist.world_size > 1:
        os.environ.update({"MASTER_ADDR": slurm[0], "MASTER_PORT": slurm[1]})
    if dist.world_size == 1 and "MASTER_ADDR" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    os.environ.setdefault("RANK", str(dist.rank))
    os.environ.setdefault("WORLD_SIZE", str(dist.world_size))
    os.environ.setdefault("LOCAL_RANK", str(dist.local_rank))


def run_train(recipe: Recipe, wandb: str | None = None, show_progress: bool = True) -> dict:
    dist = DistInfo.from_env()
    _launcher_env(dist)
    device = pick_device(recipe.target.device, dist)
    if not torch_dist.is_initialized():
        _init_distributed("nccl" if device.type == "cuda" else "gloo")
        # DeepSpeed caches its process groups for the life of the process, so the group stays up
        # across runs in one process and is torn down at exit (ranks abort if it is left open).
        atexit.register(destroy_process_group)
    config = load_config(recipe.target)
    if device.type == "cuda":
        _check_memory(recipe, config, dist, device)
    target_device = rank_devices(recipe.target, dist)[0]
    if ranks_must_agree(target_device, dist):  # every rank runs the target's parts with rank 0's dtype and kernels
        agree_on_dtype(config, target_device)
    return Trainer(recipe, dist, device, wandb or recipe.tracking.wandb, show_progress and dist.is_main).run()


def _init_distributed(backend: str) -> None:
    """deepspeed.init_distributed, without the shared-memory all-reduce op it builds on a CPU: only DeepSpeed's
    inference all-reduce (AutoTP) calls that op, training's all-reduce is torch.distributed's, and its first build
    compiles C++ for about 45 s per environment (2-core AMD EPYC, Zen 3) before any one-process smoke run."""
    backends = importlib.import_module("deepspeed.comm.torch")  # the package's `torch` attribute is torch itself
    build = getattr(backends, "build_shm_op", None)
    if build is not None:
        backends.build_shm_op = lambda: None
    try:
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    finally:
        if build is not None:
            backends.build_shm_op = build


def _check_memory(recipe: Recipe, config, dist: DistInfo, device: torch.device) -> None:
    """Refuse, before any weight is read, a run whose GPUs cannot hold what each training rank puts on them (the
    main rank's whole target for train.engine_eval included): mtptrain/memory_plan.py."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", min(dist.world_size, torch.cuda.device_count())))
    gib = gpu_memory_gib(device)
    lines = summary(check_plan(recipe, config, gib, ("train",), (dist.world_size, local)), gib)
    if dist.is_main:
        log.info("memory plan, %s", lines[0])


def _load_frozen_parts(recipe: Recipe, manifest: dict, dist: DistInfo) -> Target:
    """The target as training needs it: its embedding, final norm and LM head, the decoder layers unread (on
    the main rank, the whole target when train.engine_eval drafts with the head).

    Stores written before frozen-part fingerprints existed, and checkpoints that are not in safetensors, get the
    whole target instead.
    """
    drafts = recipe.train.engine_eval.prompts and dist.is_main  # validation through the engine: the whole target
    if manifest["target"].get("frozen_fingerprint") and not drafts:
        target = load_frozen_target(recipe.target, dist)
        if target is not None:
            return target
    return load_target(recipe.target, dist)


def _identity_to_check(recipe: Recipe, target: Target, dist: DistInfo, device: torch.device) -> dict:
    """The target's identity as the store's is checked against: with the fingerprint of all its weights unless
    train.target_check is frozen (a target loaded in part has only its frozen parts' own). The main rank reads
    the checkpoint for it and hands the fingerprint to the others."""
    identity = target.identity()
    # Every rank takes part in the hand-over, whatever it loaded: the main rank loads the whole target when
    # train.engine_eval drafts (its fingerprint is then known), the others its frozen parts only.
    if recipe.train.target_check == "full" and (target.partial or dist.world_size > 1):
        shared = from_main(lambda: target.fingerprint or _full_fingerprint(recipe), dist, device)
        if target.partial:
            identity["fingerprint"] = shared
    return identity


def _full_fingerprint(recipe: Recipe) -> str:
    """The fingerprint of every weight, read from the safetensors files one tensor at a time, or of the whole
    model loaded on the CPU where its tensors are named otherwise than the model's parameters."""
    return checkpoint_fingerprint(recipe.target) or \
        load_target(recipe.target.model_copy(update={"device": "cpu"})).fingerprint


def _log_checked(identity: dict, manifest: dict, store: Path, target_check: str) -> list[str]:
    """Say which recorded fields the store's target was checked on (the check itself has passed); returns them."""
    checked = [k for k in compared_fields(identity) if k not in ARCHITECTURE_FIELDS or k in manifest["target"]]
    described = {"fingerprint": "fingerprint (every weight)",
                 "frozen_fingerprint": "frozen_fingerprint (embedding, final norm, LM head)"}
    line = ", ".join(described.get(k, k) for k in checked)
    if "fingerprint" not in checked:
        line += (f"; not checked: fingerprint (train.target_check={target_check}; the head records the store's "
                 "value)")
    log.info("target identity checked against %s: %s", store / "manifest.json", line)
    return checked


class Trainer:
    def __init__(self, recipe: Recipe, dist: DistInfo, device: torch.device, wandb_mode: str, show_progress: bool):
        self.recipe, self.cfg, self.dist, self.device = recipe, recipe.train, dist, device
        self.pad_multiple = self.cfg.pad_multiple_on(device.type)
        self.show_progress, self.wandb_mode = show_progress, wandb_mode
        self.run_dir = Path(self.cfg.output_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        if self.cfg.online:  # the target computes the features as batches are read (features/online.py)
            manifest = self._online(recipe, dist)
        else:
            stores = store_dirs(self.cfg.features)
            manifest = combined_manifest(stores)  # several stores: checked to hold the same model's layers
            self.spec = HeadSpec.of(recipe.head, manifest)
            self.target = _load_frozen_parts(recipe, manifest, dist)
            layers = self.spec.layers
            identity = _identity_to_check(recipe, self.target, dist, device)
            # Refused here, before any training: a store of another target, or without the layers the head reads.
            self.train_store = open_stores(self.cfg.features, "train", target=identity, layers=layers)
            for store in stores:
                self.target_checked = _log_checked(identity, manifest, store, self.cfg.target_check)
            self.val_store = open_stores(self.cfg.features, "validation", target=self.target, layers=layers,
                                         verify="size")
        self.weights = step_weights(recipe.head.step_weights, self.spec.draft_positions)
        self.feature_weight = self.spec.family.feature_weight(recipe.head)
        self.loss = Loss(self.cfg.loss, self.cfg.loss_eta, self.cfg.reachable, self.cfg.topk_loss,
                         self.cfg.topk_loss_weight)
        self.steps = steps_for(len(self.train_store), self.cfg.micro_batch_size, dist.world_size,
                               self.cfg.grad_accum, self.cfg.epochs, self.cfg.max_steps)
        self.plan = BatchPlan(self.train_store.lengths(), self.cfg.micro_batch_size, self.cfg.seed,
                              dist.world_size, dist.rank, self.steps, self.cfg.grad_accum)
        self.fingerprint = run_fingerprint(recipe, manifest, dist.world_size)
        self.precision = pick_precision(self.cfg.precision, device, self.target.config)
        log.info("training precision: %s%s", self.precision, " (auto)" if self.cfg.precision == "auto" else "")
        # What computed the features the head learns from, recorded with it: the store's, or here the target's own.
        self.features_runtime = runtime_record(self.target.model, recipe.target.runtime) \
            if self.cfg.online else features_runtime(self.train_store)
        self.stop_file = self.run_dir / STOP_FILE
        # The store's check above compared the frozen parts of a partly loaded target; the features, and so the
        # head, belong to the model the store names.
        self.target_identity = {**self.target.identity(), "fingerprint": manifest["target"]["fingerprint"]}
        # Validation through the engine (train/drafting.py): held-out prompts, drafted for on the main rank.
        engine_eval = self.cfg.engine_eval
        count = min(engine_eval.prompts, len(self.val_store)) if dist.is_main else 0
        chosen = self.val_store.spread(count) if isinstance(self.val_store, FeatureStores) else range(count)
        self.prompts = [p for p in (self.val_store.prompt_ids(i) for i in chosen) if p]
        self.stops = stop_tokens(self.target.tokenizer, self.target.model) if self.prompts else set()
        self.engine_source = None
        self.best = BestHead(self.run_dir)

    # ------------------------------------------------------------------ set-up

    def _online(self, recipe: Recipe, dist: DistInfo) -> dict:
        """The whole target, and both splits as features it computes; returns the manifest they stand for."""
        self.target = load_target(recipe.target, dist)
        data = prepare_online(recipe, self.target, self.show_progress)
        self.spec = HeadSpec.of(recipe.head, data.manifest)
        self.train_store, self.val_store = (
            OnlineFeatures(self.target, samples, self.spec.layers, recipe.precompute.dtype, recipe.target.runtime)
            for samples in (data.train, data.validation))
        self.target_checked = compared_fields(self.target.identity())  # the features come from this target
        log.info("online features: %d train / %d validation samples, layers %s computed by the target each "
                 "time a batch is read", len(data.train), len(data.validation), self.spec.layers)
        return data.manifest

    def _draft_vocab(self) -> DraftVocab | None:
        store = self.train_store
        streams = (store.token_ids(i, assistant_only=True) for i in range(len(store)))  # read only if needed
        return self.spec.family.draft_vocab(self.spec, streams, self.target.vocab_size)

    def _engine(self):
        torch.manual_seed(self.cfg.seed)
        frozen = FrozenTarget.of(self.target.model)
        head = self.spec.family.build(self.spec, frozen, self._draft_vocab()).to(self.device)
        config = deepspeed_config(self.cfg, self.steps, self.dist.world_size, self.precision, self.device.type)
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.run_dir / "deepspeed.json", config)
            dump_recipe(self.recipe, self.run_dir / "recipe.yaml")
        if self.cfg.draft_lm_head == "frozen" and hasattr(head, "lm_head"):  # eagle3's own, over its draft vocabulary
            head.lm_head.weight.requires_grad_(False)
        if self.cfg.optimizer == "muon" and self.cfg.grad_clip > 0 and self.dist.is_main:
            log.info("train.grad_clip=%g is not applied under Muon, which bounds its own steps", self.cfg.grad_clip)
        engine, _, _, scheduler = deepspeed.initialize(
            model=head, model_parameters=trained_parameters(head, self.cfg), config=config)
        # every rank averages its own copy of the (replicated) weights, so any rank's is the run's
        self.average = WeightAverage(engine.module, self.cfg.ema_decay) if self.cfg.ema_decay else None
        return engine, scheduler

    def _resume(self, engine) -> dict:
        """The state of the checkpoint `latest` names, verified by every rank before any file of it is loaded."""
        tag = latest_tag(self.ckpt_dir)
        if tag is None:
            return {"micro_batch": 0, "step": 0}
        verify(self.ckpt_dir, tag, self.fingerprint, self._made_with())
        client = load(engine, self.ckpt_dir, tag)
        restore_rng(client["rng"])
        if self.average is not None:  # the fingerprint holds ema_decay: a checkpoint of this run has its averages
            self.average.load_state_dict(client.get("ema"), str(self.ckpt_dir / tag))
        log.info("resumed from %s at step %d", self.ckpt_dir / tag, client["step"])
        return client

    # ------------------------------------------------------------------ loop

    def run(self) -> dict:
        engine, scheduler = self._engine()
        state = self._resume(engine)
        finished = self.run_dir / "summary.json"
        if state["step"] >= self.steps and finished.is_file() and (self.run_dir / "head" / "config.json").is_file():
            return self._finished(engine.module, state["step"], read_summary(finished))
        metrics = MetricsLog(self.run_dir, self.dist.is_main, self.recipe, self.wandb_mode,
                             resume_id=state.get("wandb_id"))
        step = state["step"]
        metrics.forget_after(step)  # rows a killed run logged past its last checkpoint are logged again
        if self.dist.is_main:
            (self.run_dir / REQUEUE_FILE).unlink(missing_ok=True)  # this run is the requeued one
        per_step = self.plan.micro_batches_per_step
        batches = self.plan.for_rank(step * per_step)
        progress = tqdm(total=self.steps, initial=step, desc="train", unit="step", disable=not self.show_progress)
        window = Window(self.spec.draft_positions, self.device)
        totals = {"tokens": 0, "compute": 0.0, "wait": 0.0}
        # non-finite losses since the last step, counted on the device: read with the step's other flags
        unhealthy = torch.zeros((), device=self.device)
        last_checkpoint = state.get("checkpoint")
        head = engine.module
        dtype = next(head.parameters()).dtype
        try:
            clock = time.perf_counter()
            batch_source = loader(self.train_store, batches, self.cfg.num_workers, self.device.type == "cuda",
                                  self.pad_multiple)
            for k, batch in enumerate(batch_source):
                started = time.perf_counter()
                totals["wait"] += started - clock
                batch = to_device(batch, self.device, dtype)
                with autocast(self.precision, self.device):
                    result = self.spec.family.objective(head, batch, self.spec, self.weights,
                                                        self.feature_weight, self.cfg.loss_chunk, self.loss)
                unhealthy += nonfinite(result.loss)
                engine.backward(result.loss)
                engine.step()
                window.add(result)
                totals["tokens"] += int(batch["lengths"].sum())
                clock = time.perf_counter()
                totals["compute"] += clock - started
                if (k + 1) % self.cfg.grad_accum:
                    continue
                step += 1
                grad_norm = engine.get_global_grad_norm()  # None where DeepSpeed computed none (fp32, ZeRO-0)
                stop = self._check_step(engine, step, unhealthy, grad_norm, last_checkpoint)
                if self.average is not None:
                    self.average.update(step)
                progress.update(1)
                if step < self.steps and stop:
                    return self._stop(engine, step, metrics.run_id)
                if step % self.cfg.log_every == 0 or step == self.steps:
                    logged = window.reduce(self.dist)
                    if grad_norm is not None:
                        logged["train/grad_norm"] = float(grad_norm)
                    logged.update({"train/lr": self.cfg.lr * scheduler.get_lr_ratio(),
                                   "train/tokens_per_s": totals["tokens"] / max(totals["compute"], 1e-9),
                                   "train/data_wait_fraction": totals["wait"] / max(totals["wait"] + totals["compute"], 1e-9)})
                    metrics.log(step, logged)
                    progress.set_postfix(loss=f"{logged['train/loss']:.3f}", acc1=f"{logged['train/acc_1']:.3f}")
                if step % self.cfg.eval_every == 0 or step == self.steps:
                    with self._averaged():  # the head the run exports: the average under train.ema_decay
                        self.last_validation = self.validate(head, dtype)
                        if self.prompts and self.dist.is_main:
                            self.last_validation.update(self._draft(head, step))
                    # the tokens seen so far (exact, from the batch plan): the x axis of a learning curve
                    metrics.log(step, {**self.last_validation, "train/tokens_seen": self.plan.tokens_through(step)})
                if step % self.cfg.checkpoint_every == 0 or step == self.steps:
                    if self.cfg.head_snapshots and self.dist.is_main:  # first: a resume starts after the checkpoint
                        with self._averaged():
                            self._snapshot(head, step)
                    last_checkpoint = self._checkpoint(engine, step, metrics.run_id)
                clock = time.perf_counter()  # logging, validation and checkpoints are not waiting for data
            progress.close()
            summary = self._finish(head, step, totals, last_checkpoint)
            if metrics.wandb_run is not None:
                log_head_artifact(metrics.wandb_run, self.recipe, self.run_dir / "head", summary)
            return summary
        finally:
            progress.close()
            metrics.close()

    def _stop(self, engine, step: int, wandb_id: str | None) -> dict:
        checkpoint = self._checkpoint(engine, step, wandb_id)
        if self.dist.is_main:
            atomic_write_json(self.run_dir / REQUEUE_FILE, {"step": step, "checkpoint": checkpoint})
            self.stop_file.unlink(missing_ok=True)
            log.info("stopped on request (%s) at step %d; checkpoint %s", self.stop_file, step, checkpoint)
        if torch_dist.is_initialized():
            torch_dist.barrier()
        return {"steps": step, "rank": self.dist.rank, "world_size": self.dist.world_size, "stopped": True,
                "checkpoint": checkpoint, "head": None}

    @torch.no_grad()
    def validate(self, head, dtype: torch.dtype) -> dict:
        """Teacher-forced top-1 agreement with the target, per draft position, on the validation split.

        Every rank scores its share of the batches and the counts are all-reduced, so no rank waits
        in a collective while another validates alone.
        """
        if len(self.val_store) == 0:
            return {}
        with autocast(self.precision, self.device):
            window = score_store(head, self.spec, self.val_store, self.cfg.micro_batch_size, self.weights,
                                 self.feature_weight, self.cfg.loss_chunk, self.device, dtype, self.dist,
                                 self.loss, multiple=self.pad_multiple)
        return {k.replace("train/", "val/"): v for k, v in window.reduce(self.dist).items()}

    def _draft(self, head, step: int) -> dict:
        """The head drafting in the engine on the held-out prompts; the best so far kept (train/drafting.py)."""
        if self.engine_source is None:  # the target's decoder, read once and kept for every validation
            self.engine_source = runtime_for(self.target.model)
        measured = drafting_metrics(self.engine_source, head, self.spec, self.prompts, self.cfg.engine_eval,
                                    self.stops)
        self.best.offer(step, measured, lambda directory, extra: self._save(directory, head, step, extra))
        return measured

    def _save(self, directory: Path, head, step: int, extra: dict | None = None, exported: bool = True) -> None:
        """The head as it is at `step`, with the training tokens seen so far (exact, from the batch plan); in
        train.head_dtype when `exported` (a snapshot keeps the weights' own dtype)."""
        save_head(directory, head, self.spec, self.target_identity,
                  {"target_checked": self.target_checked,
                   "features": {"store": ONLINE if self.cfg.online else self.cfg.features,
                                "layers": self.train_store.layers, "runtime": self.features_runtime},
                   "precision": self.precision,
                   "train": {"steps": step, "tokens": self.plan.tokens_through(step),
                             "recipe": self.recipe.model_dump(mode="json")}, **(extra or {})},
                  dtype=getattr(torch, self.cfg.head_dtype) if exported else None)

    def _check_step(self, engine, step: int, unhealthy: torch.Tensor, grad_norm, last_checkpoint) -> bool:
        """After an optimizer step: raise on a non-finite loss on any rank since the last step, or a non-finite
        norm of an applied step; return whether a stop was asked for (the STOP file, as rank 0 sees it).

        In fp16, an overflowing step is skipped by DeepSpeed while it calibrates the loss scale: normal,
        not divergence. The flags are all-reduced so that every rank stops at the same step, and read on the host
        in one transfer: the one wait for the device per step, before anything of the step is checkpointed.
        """
        skipped = self.precision == "fp16" and not engine.was_step_applied()
        stop = self.dist.is_main and self.stop_file.exists()
        # (non-finite losses, a non-finite norm, STOP); host values copied up without a wait (non_blocking)
        flags = torch.tensor([0.0, 0.0, float(stop)], dtype=torch.float64).to(self.device, non_blocking=True)
        flags[0] += unhealthy
        if grad_norm is not None and not skipped:  # a float, or a tensor on the device
            flags[1] += nonfinite(torch.as_tensor(grad_norm, dtype=torch.float64).to(self.device, non_blocking=True))
        if self.dist.world_size > 1:
            torch_dist.all_reduce(flags)
        bad_loss, bad_norm, stop = (value > 0 for value in flags.tolist())
        unhealthy.zero_()
        if bad_loss or bad_norm:
            what = "the loss" if bad_loss else f"the gradient norm ({float(grad_norm)})"
            raise TrainingDiverged(f"{what} is not finite at step {step}; last good checkpoint: "
                                   f"{last_checkpoint or 'none yet'}. Lower train.lr or check the data.")
        return stop

    def _made_with(self) -> dict:
        """What a checkpoint records of how this run computes, and a resume must match."""
        return {"precision": self.precision, "features": self.features_runtime}

    def _checkpoint(self, engine, step: int, wandb_id: str | None) -> str:
        """Save every rank's state for `step`; rank 0 then records the files and moves `latest` to them."""
        tag = tag_for(step)
        client = {"fingerprint": self.fingerprint, "step": step, "micro_batch": step * self.plan.micro_batches_per_step,
                  "checkpoint": str(self.ckpt_dir / tag), "wandb_id": wandb_id, "rng": rng_state(),
                  **({"ema": self.average.state_dict()} if self.average is not None else {})}
        engine.save_checkpoint(str(self.ckpt_dir), tag=tag, client_state=client, save_latest=False)
        if self.dist.is_main:  # DeepSpeed's save ends in a barrier: every rank's files are written
            commit(self.ckpt_dir, tag, self.fingerprint, self._made_with())
        if self.dist.world_size > 1:
            torch_dist.barrier()
        return str(self.ckpt_dir / tag)

    def _averaged(self):
        """The weight average in the head while the block runs (train.ema_decay), the live weights otherwise."""
        return self.average.applied() if self.average is not None else nullcontext()

    def _snapshot(self, head, step: int) -> None:
        self._save(self.run_dir / "snapshots" / f"step-{step:07d}", head, step, exported=False)

    def _finish(self, head, step: int, totals: dict, last_checkpoint: str | None) -> dict:
        summary = {"steps": step, "rank": self.dist.rank, "world_size": self.dist.world_size,
                   "tokens_per_second": totals["tokens"] / max(totals["compute"], 1e-9),
                   "data_wait_fraction": totals["wait"] / max(totals["wait"] + totals["compute"], 1e-9),
                   "checkpoint": last_checkpoint, "head": str(self.run_dir / "head")}
        if self.dist.is_main:
            summary.update(getattr(self, "last_validation", {}))
            with self._averaged():
                self._export(head, step, summary)
        if torch_dist.is_initialized():
            torch_dist.barrier()
        return summary

    def _finished(self, head, step: int, summary: dict) -> dict:
        """A run that has trained all its steps: its summary as written, after exporting again where the recipe
        now asks for the other head (engine_eval.select_best switched since): the last step's head is the
        checkpoint just loaded, the best one is in best-head/."""
        want = self.best.step if self.cfg.engine_eval.select_best and self.best.step is not None else None
        if summary.get("selected", {}).get("step") == want:
            log.info("%s already finished its %d steps; nothing to do", self.run_dir, self.steps)
        elif self.dist.is_main:
            log.info("%s already finished its %d steps; exporting the %s head as engine_eval.select_best now asks",
                     self.run_dir, self.steps, "last step's" if want is None else f"step {want}")
            with self._averaged():
                self._export(head, step, summary)
        if torch_dist.is_initialized():
            torch_dist.barrier()
        return {**summary, "rank": self.dist.rank}

    def _export(self, head, step: int, summary: dict) -> None:
        """Write <run>/head (the best validated head under engine_eval.select_best, else `head` at `step`) and
        summary.json, which records the step of a selected head under "selected"."""
        exported = self.run_dir / "head"
        summary.pop("selected", None)
        if self.cfg.engine_eval.select_best and self.best.step is not None:
            # the head of the best validated chain tau, which may be an earlier step's
            shutil.rmtree(exported, ignore_errors=True)
            shutil.copytree(self.best.directory, exported)
            summary["selected"] = {"step": self.best.step, "tau_chain": self.best.tau}
            log.info("exported the head of step %d (best validated chain tau %.3f) to %s", self.best.step,
                     self.best.tau, exported)
        else:
            self._save(exported, head, step)
        atomic_write_json(self.run_dir / "summary.json", summary)


def read_summary(path: Path) -> dict:
    """A finished run's summary.json, refused naming the file if it is not a JSON object (or its "selected" not
    one): a damaged summary would otherwise crash the rerun, or stand for a head it does not describe."""
    try:
        summary = load_json(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        summary = exc
    if not isinstance(summary, dict) or not isinstance(summary.get("selected", {}), dict):
        why = summary if isinstance(summary, Exception) else "not an object of the fields it writes"
        raise MtptrainError(f"{path}: not a summary written by mtptrain train ({why}); delete it and rerun the "
                            "same command to export the head again")
    return summary


def log_head_artifact(run, recipe: Recipe, head_dir: Path, summary: dict) -> None:
    """The trained head as a W&B model artifact, with its export in recipe.export.format (or, when that format
    cannot hold this head, the first one that can), and the run's summary numbers."""
    # wandb takes ~0.3 s to import, which a run with W&B off would pay for nothing; init_run has loaded it by now
    import wandb

    config = json.loads((head_dir / "config.json").read_text())
    checked = config.get("target_checked", [])
    artifact = wandb.Artifact(f"{recipe.name}-head", type="model",
                              metadata={"head": config["head"], "steps": summary["steps"]})
    artifact.add_dir(str(head_dir), name="head")
    fmt, formats = recipe.export.format, HeadSpec(**config["head"]).family.export_formats
    if fmt not in formats:
        fmt = formats[0]
    try:
        out = head_dir.parent / "export" / fmt
        export_head(head_dir, out, recipe.export.model_copy(update={"format": fmt}),
                    check_target="fingerprint" not in checked)
        artifact.add_dir(str(out), name=f"export-{fmt}")
    except ExportError as exc:  # e.g. an eagle head with restored norms: no format holds it
        log.warning("the W&B artifact holds the head without an export: %s", exc)
        artifact.metadata["export"] = str(exc)
    run.log_artifact(artifact)
    run.summary.update({k: v for k, v in summary.items() if k.startswith("val/") or k == "tokens_per_second"})
