"""What each GPU of a node holds over the stages a recipe runs, and a refusal, before any job starts, of a plan
that does not fit.

A rank's GPUs are fixed by its local rank: precompute and eval rank r spans GPUs r*N .. r*N+N-1
(target.gpus_per_rank = N), training rank r uses GPU r. Training's main rank also runs the whole target when
train.engine_eval drafts with the head, on GPUs 0 .. N-1, where training ranks 0 .. N-1 already sit. Each GPU's
sum is checked against its memory less a reserve for the CUDA context, NCCL buffers and fragmentation.

Weights are counted exactly from the target's config (and the head built on the meta device); activations are
estimates, stated next to each term, that `scripts/gpu_check.py` measures against on a real GPU
(docs/scale.md compares them).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from mtptrain.config import Recipe
from mtptrain.errors import MtptrainError
from mtptrain.features.compute import TOP_CHUNK
from mtptrain.target.layers import resolve_layers
from mtptrain.heads.common import FrozenTarget
from mtptrain.heads.spec import HeadSpec
from mtptrain.target.parts import meta_model

GIB = 2**30
RESERVE_GIB = 4.0  # CUDA context (~0.5 GiB), NCCL buffers, the caching allocator's fragmentation
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2}  # auto = bfloat16 on CUDA
ENGINE = "engine validation"  # what training's main rank adds for train.engine_eval


class PlanError(MtptrainError, ValueError):
    """A stage's GPUs cannot hold what the recipe puts on them; the message names the GPU, the terms and a fix."""


@dataclass
class GpuLoad:
    stage: str
    gpu: int
    terms: list[tuple[str, float]] = field(default_factory=list)  # (what, bytes)

    def add(self, what: str, size: float) -> None:
        self.terms.append((what, size))

    @property
    def total(self) -> float:
        return sum(size for _, size in self.terms)

    def describe(self) -> str:
        return " + ".join(f"{what} {size / GIB:.1f}" for what, size in self.terms) + f" = {self.total / GIB:.1f} GiB"


@dataclass(frozen=True)
class TargetShape:
    """Parameter counts of a Llama-like target, from its transformers config."""

    hidden: int
    intermediate: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool

    @classmethod
    def of(cls, config) -> TargetShape:
        heads = config.num_attention_heads
        return cls(config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size, heads,
                   getattr(config, "num_key_value_heads", None) or heads,
                   getattr(config, "head_dim", None) or config.hidden_size // heads,
                   bool(getattr(config, "tie_word_embeddings", False)))

    @property
    def layer_params(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden


def target_on_gpus(load: list[GpuLoad], shape: TargetShape, width: int) -> None:
    """The whole target cut as `split_device_map` cuts it over load's GPUs: layers in equal runs, the embedding on
    the first, the final norm and an untied LM head on the last (a tied one stays with the embedding)."""
    count = len(load)
    for i, gpu in enumerate(load):
        layers = sum(1 for layer in range(shape.layers) if layer * count // shape.layers == i)
        gpu.add(f"{layers} decoder layers", layers * shape.layer_params * width)
    load[0].add("embedding", shape.embedding_params * width)
    if not shape.tied:
        load[-1].add("LM head", shape.embedding_params * width)


def head_parameters(recipe: Recipe, config, layers: list[int]) -> int:
    """The head's parameter count, built on the meta device from the recipe's head section."""
    with torch.device("meta"):
        frozen = FrozenTarget.of(meta_model(config, torch.bfloat16, recipe.target))
        manifest = {"layers": layers, "last_layer": layers[-1], "target": {"vocab_size": config.vocab_size}}
        spec = HeadSpec.of(recipe.head, manifest)
        head = spec.family.build(spec, frozen)
    return sum(p.numel() for p in head.parameters() if p.requires_grad)


def precompute_load(recipe: Recipe, shape: TargetShape, stored: int) -> list[GpuLoad]:
    """One precompute rank's GPUs: the split target, and on each GPU a batch's activations (an MLP's gate and up
    products and the attention's inputs and outputs, batch_tokens rows each), the captured layers, and on the last
    the LM head's product over TOP_CHUNK rows in float32."""
    width = DTYPE_BYTES[recipe.target.dtype]
    load = [GpuLoad("precompute", g) for g in range(recipe.target.gpus_per_rank)]
    target_on_gpus(load, shape, width)
    tokens = recipe.precompute.batch_tokens
    for gpu in load:
        gpu.add("activations", tokens * (2 * shape.intermediate + 6 * shape.hidden) * width)
    load[0].add("captured layers", tokens * stored * shape.hidden * width)
    load[-1].add("LM head product", TOP_CHUNK * shape.vocab * 4)
    return load


def train_load(recipe: Recipe, shape: TargetShape, head_params: int, world: int, rank: int) -> GpuLoad:
    """Training rank `rank`'s GPU: the target's frozen parts, the head with its gradients and optimizer state
    (mixed precision: 16-bit weights and gradients, float32 master weights and two AdamW moments, 12 bytes a
    parameter, sharded over the ranks by ZeRO-1/2), and the training-time-test activations: per token and TTT step
    about 12 hidden-size and 3 intermediate-size values kept for backward, plus the distillation targets over the
    draft vocabulary (float32, every position) and one loss chunk's full-vocabulary logits; under train.ema_decay
    a float32 copy of the head's weights. The micro-batch's length is data.max_length rounded up as
    train.pad_multiple rounds it on a GPU."""
    cfg = recipe.train
    width = DTYPE_BYTES[recipe.target.dtype]
    gpu = GpuLoad("train", rank)
    gpu.add("frozen embedding, norm, LM head", shape.embedding_params * width * (1 if shape.tied else 2))
    mixed = cfg.precision in ("bf16", "fp16", "auto")
    weights, grads, states = (2, 2, 12) if mixed else (4, 4, 8)
    stage = cfg.zero_stage
    sharded_states = states / world if stage >= 1 else states
    sharded_grads = grads / world if stage >= 2 else grads
    gpu.add("head weights, gradients, optimizer", head_params * (weights + sharded_grads + sharded_states))
    if cfg.ema_decay:  # every rank keeps the whole average, in float32
        gpu.add("weight average (train.ema_decay)", head_params * 4)
    multiple = cfg.pad_multiple_on("cuda")  # the longest micro-batch, rounded on the GPU
    tokens = cfg.micro_batch_size * -(-recipe.data.max_length // multiple) * multiple
    steps = getattr(recipe.head, "ttt_steps", None) or getattr(recipe.head, "depths", None) or 1
    gpu.add(f"activations ({steps} TTT steps)", tokens * steps * (12 * shape.hidden + 3 * shape.intermediate) * width)
    draft_vocab = getattr(recipe.head, "draft_vocab_size", None) or shape.vocab
    gpu.add("distillation targets", tokens * draft_vocab * 4)
    gpu.add("loss chunk logits", cfg.loss_chunk * shape.vocab * 4 * 2)
    return gpu


def eval_load(recipe: Recipe, shape: TargetShape, head_params: int, stage: str = "eval") -> list[GpuLoad]:
    """The whole target over target.gpus_per_rank GPUs with its KV cache for one answer (keys and values of every
    layer, prompt and answer at data.max_length), the head in the target's dtype on the first."""
    width = DTYPE_BYTES[recipe.target.dtype]
    load = [GpuLoad(stage, g) for g in range(recipe.target.gpus_per_rank)]
    target_on_gpus(load, shape, width)
    positions = recipe.data.max_length + recipe.eval.max_new_tokens
    cache = 2 * shape.layers * shape.kv_heads * shape.head_dim * positions * width
    for gpu in load:
        gpu.add("KV cache", cache / len(load))
    load[0].add("head", head_params * width)
    return load


STAGES = ("precompute", "train", "eval")


def plan_loads(recipe: Recipe, config, stages: tuple[str, ...] = STAGES,
               train_ranks: tuple[int, int] | None = None) -> list[GpuLoad]:
    """Every GPU's load, per stage, on one node of the recipe's Slurm plan; `train_ranks` (world size, ranks on
    this node) in place of slurm.train's where training was started otherwise (torchrun)."""
    shape = TargetShape.of(config)
    layers = resolve_layers(recipe.precompute.layers, shape.layers)
    head_params = head_parameters(recipe, config, layers)
    loads: list[GpuLoad] = []
    if "precompute" in stages:
        loads += precompute_load(recipe, shape, len(layers))
    if "train" in stages:
        slurm = recipe.slurm.train
        world, local = train_ranks or (slurm.nodes * slurm.tasks_per_node, slurm.tasks_per_node)
        ranks = [train_load(recipe, shape, head_params, world, r) for r in range(local)]
        if recipe.train.engine_eval.prompts:  # the main rank runs the whole target on GPUs 0 .. N-1
            for gpu in eval_load(recipe, shape, head_params, "train"):
                ranks[gpu.gpu].terms += [(f"{ENGINE}: {what}", size) for what, size in gpu.terms]
        loads += ranks
    if "eval" in stages:
        loads += eval_load(recipe, shape, head_params)
    return loads


def check_plan(recipe: Recipe, config, gpu_gib: float, stages: tuple[str, ...] = STAGES,
               train_ranks: tuple[int, int] | None = None) -> list[GpuLoad]:
    """The loads, or PlanError naming every GPU over its memory less RESERVE_GIB, with what fills it and a fix."""
    loads = plan_loads(recipe, config, stages, train_ranks)
    usable = (gpu_gib - RESERVE_GIB) * GIB
    over = [load for load in loads if load.total > usable]
    if not over:
        return loads
    lines = [f"{load.stage}, GPU {load.gpu}: {load.describe()}" for load in over]
    raise PlanError(f"the recipe does not fit GPUs of {gpu_gib:g} GiB ({RESERVE_GIB:g} GiB kept for the CUDA "
                    "context and NCCL): " + "; ".join(lines) + ". " + _fix(recipe, over, usable))


def _fix(recipe: Recipe, over: list[GpuLoad], usable: float) -> str:
    stages = Counter(load.stage for load in over)
    fixes = []
    if any(what.startswith(ENGINE) for load in over for what, _ in load.terms):
        fixes.append("set train.engine_eval.prompts=0 (the main training rank would load the whole target beside "
                     "its head; measure acceptance with `mtptrain eval` after training)")
    if any(load.stage == "train" and sum(size for what, size in load.terms if not what.startswith(ENGINE)) > usable
           for load in over):
        fixes.append(f"lower train.micro_batch_size (now {recipe.train.micro_batch_size}) and raise "
                     "train.grad_accum to keep the step, or lower train.loss_chunk")
    if "precompute" in stages or "eval" in stages:
        more = recipe.target.gpus_per_rank * 2
        fixes.append(f"lower precompute.batch_tokens, or split the target over more GPUs per rank "
                     f"(target.gpus_per_rank={more}, with slurm.<stage>.tasks_per_node lowered to match)")
    return "Fix: " + "; or ".join(fixes) + "."


def gpu_memory_gib(device: torch.device | None = None) -> float | None:
    """The memory of this machine's GPU (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(device or 0).total_memory / GIB


def summary(loads: list[GpuLoad], gpu_gib: float) -> list[str]:
    """One line per stage: its fullest GPU."""
    lines = []
    for stage in dict.fromkeys(load.stage for load in loads):
        top = max((load for load in loads if load.stage == stage), key=lambda load: load.total)
        lines.append(f"{stage}: fullest GPU {top.gpu} holds {top.total / GIB:.1f} of {gpu_gib:g} GiB "
                     f"({top.describe()})")
    return lines
