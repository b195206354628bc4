"""What every export format shares: the Format interface, and the Llama draft layer the EAGLE formats use."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Protocol

import torch

from mtptrain.config import ExportConfig
from mtptrain.export.sidecar import ExportError
from mtptrain.heads.spec import FAMILIES, HeadSpec

# A Llama decoder layer's tensors (no biases, no q/k norms): the layer every EAGLE format's draft is built of.
LLAMA_LAYER = ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
               "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
               "mlp.down_proj.weight", "post_attention_layernorm.weight")


class HeadToExport(Protocol):
    """What a format reads of the head it writes and of its target (mtptrain/export/source.py: HeadSource)."""

    spec: HeadSpec
    state: dict[str, torch.Tensor]  # the head's weights, our names
    target_config: dict  # the target's transformers config, as a dict

    @property
    def float_dtype(self) -> torch.dtype: ...

    def served_target(self) -> str: ...

    def target_config_json(self) -> dict: ...

    def target_tensor(self, *names: str) -> torch.Tensor: ...


@dataclass
class Written:
    tensors: dict[str, torch.Tensor]
    config: dict
    notes: list[str] = field(default_factory=list)  # facts the README spells out


class Format(ABC):
    name = ""
    title = ""

    @property
    def kinds(self) -> tuple[str, ...]:
        """The head families this format holds: each family lists the formats that hold it."""
        return tuple(kind for kind, family in FAMILIES.items() if self.name in family.export_formats)

    def check(self, src: HeadToExport, cfg: ExportConfig) -> None:
        """Raise ExportError when the format cannot express this head (its family is checked by `format_for`)."""

    @abstractmethod
    def write(self, src: HeadToExport, cfg: ExportConfig) -> Written:
        """The export's tensors (engine names) and config."""

    @abstractmethod
    def to_head(self, tensors: dict[str, torch.Tensor], sidecar: dict) -> dict[str, torch.Tensor]:
        """The inverse of write: the export's tensors under the head's own names."""

    @abstractmethod
    def serve(self, out: str, target: str, sidecar: dict) -> list[tuple[str, str]]:
        """(engine, command) pairs that serve the export."""

    def checked(self) -> str:
        """Which serving engine, at which version, was seen serving the format (empty: none here)."""
        return ""


def draft_llama_config(src: HeadToExport) -> dict:
    """A one-layer Llama config with the target's attention, MLP, rope and vocabulary settings.

    Rope is written both ways: transformers 5 reads rope_parameters, older engines rope_theta / rope_scaling.
    """
    tc = src.target_config
    if tc.get("hidden_act", "silu") != "silu":
        raise ExportError(f"the target's hidden_act is {tc.get('hidden_act')!r}; a Llama draft layer uses silu")
    heads = tc["num_attention_heads"]
    rope = dict(tc.get("rope_parameters") or {})
    theta = rope.get("rope_theta", tc.get("rope_theta", 10000.0))
    scaling = tc.get("rope_scaling") or ({k: v for k, v in rope.items() if k != "rope_theta"}
                                        if rope.get("rope_type", "default") != "default" else None)
    return {
        "model_type": "llama",
        "hidden_size": tc["hidden_size"],
        "intermediate_size": tc["intermediate_size"],
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": tc.get("num_key_value_heads", heads),
        "head_dim": tc.get("head_dim") or tc["hidden_size"] // heads,
        "hidden_act": "silu",
        "rms_norm_eps": tc["rms_norm_eps"],
        "max_position_embeddings": tc["max_position_embeddings"],
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rope_parameters": {"rope_theta": theta, **(scaling or {"rope_type": "default"})},
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": tc["vocab_size"],
        "tie_word_embeddings": False,
        "bos_token_id": tc.get("bos_token_id"),
        "eos_token_id": tc.get("eos_token_id"),
        "pad_token_id": tc.get("pad_token_id"),
        "torch_dtype": str(src.float_dtype).removeprefix("torch."),
    }


def check_llama_layer(src: HeadToExport, prefix: str, expected: tuple[str, ...], fmt: str) -> None:
    """The head's decoder layer must hold exactly a Llama layer's tensors: anything else would be dropped."""
    have = {k[len(prefix):] for k in src.state if k.startswith(prefix)}
    extra, missing = sorted(have - set(expected)), sorted(set(expected) - have)
    if extra or missing:
        model_type = src.target_config.get("model_type")
        raise ExportError(
            f"the head's decoder layer is a {model_type} layer with "
            + (f"tensors a Llama layer lacks ({', '.join(extra)})" if extra else "")
            + (" and " if extra and missing else "")
            + (f"without {', '.join(missing)}" if missing else "")
            + f"; the {fmt} format's draft layer is a plain Llama layer and would drop or invent them")


def renamed(state: dict[str, torch.Tensor], names: dict[str, str]) -> dict[str, torch.Tensor]:
    return {theirs: state[ours].contiguous() for ours, theirs in names.items()}


def inverse(tensors: dict[str, torch.Tensor], names: dict[str, str]) -> dict[str, torch.Tensor]:
    missing = [theirs for theirs in names.values() if theirs not in tensors]
    if missing:
        raise ExportError(f"the export lacks {', '.join(missing[:5])}")
    return {ours: tensors[theirs] for ours, theirs in names.items()}
