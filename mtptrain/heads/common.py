"""What every draft head shares: the target's frozen parts, and the fusion block.

A head is a plain nn.Module: no DeepSpeed, W&B or files in here. The target's
embedding and LM head (tied) are frozen and shared by reference. They are kept
outside the head's module tree, so they are never in its state_dict, its
parameters or an optimizer.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(frozen=True)
class FrozenTarget:
    """References to the target's frozen embedding, final norm and LM head, and its layer classes."""

    embed: nn.Module
    final_norm: nn.Module
    lm_head: nn.Module
    config: object  # the target's transformers config
    layer_class: type  # the target's decoder layer (LlamaDecoderLayer, Qwen2DecoderLayer, ...)
    rotary_class: type
    laid_out: dict = field(default_factory=dict, compare=False, repr=False)  # product -> the LM head laid out

    @classmethod
    def of(cls, model: nn.Module) -> "FrozenTarget":
        decoder = model.get_decoder()
        for module in (model.get_input_embeddings(), decoder.norm, model.get_output_embeddings()):
            module.requires_grad_(False)
        return cls(model.get_input_embeddings(), decoder.norm, model.get_output_embeddings(), model.config,
                   type(decoder.layers[0]), type(decoder.rotary_emb))

    def normed(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's final norm of its pre-norm states, in the LM head's dtype, on `hidden`'s device."""
        return across(self.final_norm, hidden.to(self.lm_head.weight.dtype))

    def target_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's own logits from its pre-norm last-layer state: final norm, then LM head."""
        return across(self.lm_head, self.normed(hidden))

    def embed_as(self, ids: torch.Tensor, like: nn.Module) -> torch.Tensor:
        """Token embeddings on a head's device, in the dtype of its own weights (a bf16 head over an fp32 target,
        say)."""
        return across(self.embed, ids).to(next(like.parameters()).dtype)

    def lm_head_for(self, product) -> object:
        """The frozen LM head's weight laid out for `product` (runtime/products.py), made once per product: the
        drafting steps of every head that shares it (heads/fast.py) read this one copy, on the LM head's device."""
        if product.name not in self.laid_out:
            with torch.inference_mode(False), torch.no_grad():
                self.laid_out[product.name] = product.lay_out(self.lm_head.weight)
        return self.laid_out[product.name]

    def head_logits(self, states: torch.Tensor) -> torch.Tensor:
        """The frozen LM head applied to a head's (already normed) states."""
        return across(self.lm_head, states.to(self.lm_head.weight.dtype))


def across(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` on the module's device, returned on x's. The frozen parts of a target split over several GPUs
    (target.gpus_per_rank) sit apart: the embedding with the first decoder layers, the final norm and an untied
    LM head with the last, while a head lives with the embedding. Only activations cross (a step's few rows, or a
    training chunk's); on one device both moves are no-ops."""
    device = next(module.parameters()).device
    return module(x.to(device)).to(x.device)


def as_head_input(states: torch.Tensor, head: nn.Module) -> torch.Tensor:
    """Target states [n, H] as a batch of one on the head's device, in its weights' dtype."""
    parameter = next(head.parameters())
    return states[None].to(parameter.device, parameter.dtype)


def head_layer_config(target_config):
    """The target's config for a single-layer head, always with sdpa attention.

    Heads pass explicit masks for cached steps and TTT, and rely on sdpa's
    is_causal for full sequences: eager attention without a mask would not be
    causal, and flash-attn takes no arbitrary masks.
    """
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = 1
    config._attn_implementation = "sdpa"
    return config


def rms_norm_like(final_norm: nn.Module, hidden_size: int) -> nn.Module:
    """A fresh RMSNorm of the target's own class and epsilon, initialised to ones, in float32 like the
    head's other fresh layers (whatever dtype the target was loaded in)."""
    norm = copy.deepcopy(final_norm)
    assert norm.weight.shape[-1] == hidden_size
    norm.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32, device=final_norm.weight.device))
    return norm


def attention_mask(q_len: int, past_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """Additive causal mask [1, 1, q_len, past_len + q_len], or None where plain causal attention is exact.

    With earlier positions in a cache, torch's is_causal aligns the triangle to
    the top-left corner, which is wrong; the mask aligns it to the bottom-right.
    """
    if past_len == 0:
        return None
    q_pos = torch.arange(past_len, past_len + q_len, device=device)[:, None]
    kv_pos = torch.arange(past_len + q_len, device=device)[None, :]
    mask = torch.zeros(q_len, past_len + q_len, dtype=dtype, device=device)
    return mask.masked_fill_(kv_pos > q_pos, torch.finfo(dtype).min)[None, None]


class FusionBlock(nn.Module):
    """[embedding ; feature] -> one decoder layer of the target's own kind.

    The shape shared by the EAGLE head and a DeepSeek-V3 MTP module:

        x = proj([norm_e(e) ; norm_h(h)])      (norms only when `norms` is "restored")
        out = decoder_layer(x)                 (the layer keeps its own input norm when restored)

    `out` lives in the space of the target's pre-norm hidden states.
    """

    def __init__(self, target: FrozenTarget, norms: str = "restored", proj_bias: bool = False):
        super().__init__()
        if norms not in ("restored", "stripped"):
            raise ValueError(f"norms must be 'restored' or 'stripped', not {norms!r}")
        hidden = target.config.hidden_size
        self.norms = norms
        restored = norms == "restored"
        self.norm_embed = rms_norm_like(target.final_norm, hidden) if restored else nn.Identity()
        self.norm_hidden = rms_norm_like(target.final_norm, hidden) if restored else nn.Identity()
        self.proj = nn.Linear(2 * hidden, hidden, bias=proj_bias)
        config = head_layer_config(target.config)
        self.layer = target.layer_class(config, layer_idx=0)
        if not restored:
            # The original EAGLE placement: the head's decoder layer has no input norm.
            self.layer.input_layernorm = nn.Identity()
        self.rotary = target.rotary_class(config=config)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                cache=None, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.proj(torch.cat([self.norm_embed(embeds), self.norm_hidden(hidden)], dim=-1))
        if mask is None and cache is not None:
            mask = attention_mask(x.shape[1], cache.get_seq_length(), x.dtype, x.device)
        position_embeddings = self.rotary(x, position_ids)
        out = self.layer(x, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                         use_cache=cache is not None, position_embeddings=position_embeddings)
        return out[0] if isinstance(out, tuple) else out

