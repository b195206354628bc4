"""The EAGLE-3 draft head (Li et al., arXiv:2503.01840).

Three differences from EAGLE-1/2:

* Fused features. The target's states from a low, a middle and a high layer
  are concatenated and projected: fc [3H -> H]. The decoder layer's attention
  reads [input_norm(embedding) ; hidden_norm(feature)], so its q/k/v
  projections take 2H inputs. The residual stream is the feature.
* Training-time test (TTT). During training the head is unrolled for several
  steps, each reading its own previous output as the feature. Step j at
  position t reads (f^j_t, embedding of x_{t+1+j}) and predicts x_{t+2+j};
  f^0_t = fc(fused target states at t), f^j_t = the head's output of step j-1.
  Its attention sees what it would see while drafting: the step-0 entries at
  positions <= t (computed from the target's real states) and its own chain
  at position t from steps 1..j. Rotary position of step j is t + j.
* Reduced draft vocabulary. The head predicts over the N most frequent
  target tokens of the training data, with draft->target and target->draft
  maps. Its LM head [N, H] starts as those rows of the target's LM head and
  is trained. The embedding stays the target's own, frozen.

Eagle3Family, at the end, is what the rest of the package asks of the family
(mtptrain/heads/family.py): its spec, draft vocabulary, objective, drafters and
export formats.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from mtptrain.heads.common import FrozenTarget, as_head_input, attention_mask, head_layer_config, rms_norm_like
from mtptrain.heads.family import EagleStyleFamily, HeadSettingsError
from mtptrain.heads.fast import Drafting, HeadStepper
from mtptrain.heads.losses import Loss
from mtptrain.heads.objective import distill_positions, given
from mtptrain.heads.settings import HeadSettings
from mtptrain.heads.vocab import DraftVocab
from mtptrain.runtime.attention import folded_mask
from mtptrain.runtime.model import rms_norm, rotate_half


class Eagle3Head(nn.Module):
    def __init__(self, target: FrozenTarget, vocab: DraftVocab, num_features: int = 3, fc_norm: bool = False,
                 norm_output: bool = False):
        super().__init__()
        config = target.config
        hidden = config.hidden_size
        self.frozen = target  # a plain attribute: not a submodule, never in state_dict
        # EAGLE-3.1: a norm per fused layer before fc, and steps that carry the normed output
        self.fc_norm = (nn.ModuleList(rms_norm_like(target.final_norm, hidden) for _ in range(num_features))
                        if fc_norm else None)
        self.norm_output = norm_output
        self.fc = nn.Linear(num_features * hidden, hidden, bias=False)
        layer = target.layer_class(head_layer_config(config), layer_idx=0)
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):  # attention reads [embedding ; feature]: 2H inputs
            old = getattr(attn, name)
            setattr(attn, name, nn.Linear(2 * hidden, old.out_features, bias=old.bias is not None))
        self.layer = layer
        self.hidden_norm = rms_norm_like(target.final_norm, hidden)
        self.rotary = target.rotary_class(config=head_layer_config(config))
        self.norm = rms_norm_like(target.final_norm, hidden)
        self.lm_head = nn.Linear(hidden, len(vocab), bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(target.lm_head.weight[vocab.draft_to_target])
        self.register_buffer("draft_to_target", vocab.draft_to_target.clone())
        self.register_buffer("target_to_draft", vocab.target_to_draft.clone())

    def fuse(self, layer_states: list[torch.Tensor]) -> torch.Tensor:
        """The step-0 feature from the target's states at the captured layers, low to high."""
        if self.fc_norm is not None:
            layer_states = [norm(states) for norm, states in zip(self.fc_norm, layer_states, strict=True)]
        return self.fc(torch.cat(layer_states, dim=-1))

    def draft_input(self, hidden: dict[int, torch.Tensor], spec: HeadSettings) -> torch.Tensor:
        """What the head drafts from, out of the target's captured states (layer -> [n, H]): its feature layers,
        fused [1, n, H]."""
        return self.fuse([as_head_input(hidden[layer], self) for layer in spec.feature_layers])

    def forward(self, feature: torch.Tensor, next_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                cache=None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """One step: feature [B, T, H] at positions t (fused, or the head's own carried state), next_ids =
        x_{t+1}. Returns the state it carries (`carry`)."""
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(past, past + next_ids.shape[1], device=next_ids.device)[None]
        if mask is None and cache is not None:
            mask = attention_mask(feature.shape[1], cache.get_seq_length(), feature.dtype, feature.device)
        x = self.attention_input(feature, next_ids)
        attended, _ = self.layer.self_attn(x, position_embeddings=self.rotary(feature, position_ids),
                                           attention_mask=mask, past_key_values=cache, position_ids=position_ids)
        out = feature + attended
        return self.carry(out + self.layer.mlp(self.layer.post_attention_layernorm(out)))

    def carry(self, out: torch.Tensor) -> torch.Tensor:
        """What a step hands on, from its layer's output: the next step's feature, and what `logits` reads. The
        output itself, or (norm_output) the output after the final norm, which the LM head then reads as is."""
        return self.norm(out) if self.norm_output else out

    def attention_input(self, feature: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """[normed embedding of x_{t+1} ; normed feature t] [B, T, 2H]: what the layer's attention reads."""
        embeds = self.frozen.embed_as(next_ids, self)
        return torch.cat([self.layer.input_layernorm(embeds), self.hidden_norm(feature)], dim=-1)

    def stepper(self, spec: HeadSettings, int8: bool = False) -> HeadStepper:
        """This head's drafting steps on the runtime's kernels (heads/fast.py), around its layer the fused
        operations of `Eagle3Drafting` on copies of its weights as they are now (`int8`: HeadStepper's)."""
        return HeadStepper(self.layer, self.rotary, head_layer_config(self.frozen.config),
                           lambda stepper: Eagle3Drafting(self, spec, stepper).drafting(), lm_head=self.lm_head,
                           logits_input=None if self.norm_output else self.norm, int8=int8)

    def unroll(self, fused: torch.Tensor, input_ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test over whole sequences: fused [B, T, H] (step-0 features), input_ids [B, T].

        Step j covers positions t = 0 .. T-2-j (those with x_{t+1+j} known) and returns states that
        predict x_{t+2+j}. The attention of step j over the keys of [step 0 | step 1 | ... | step j] is
        causal on the step-0 block and diagonal on the others (`ttt_mask`): position t sees positions
        0..t of step 0 and its own position in each later step. Only those entries are computed here
        (`ttt_attention`); a head whose attention has q/k norms (Qwen3) takes the masked path
        (`unroll_masked`), which computes the same through the layer's own attention.
        """
        attn = self.layer.self_attn
        if hasattr(attn, "q_norm"):
            return self.unroll_masked(fused, input_ids, steps)
        length = input_ids.shape[1] - 1
        batch = fused.shape[0]
        config = self.frozen.config
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        dim = attn.head_dim
        causal = torch.ones(length, length, dtype=torch.bool, device=fused.device).tril()
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outputs: list[torch.Tensor] = []
        feature = fused[:, :length]
        for step in range(min(steps, length)):
            tokens, positions = _step_inputs(input_ids, step)
            x = self.attention_input(feature, tokens)
            q = attn.q_proj(x).view(batch, length, heads, dim).transpose(1, 2)
            k = attn.k_proj(x).view(batch, length, kv_heads, dim).transpose(1, 2)
            v = attn.v_proj(x).view(batch, length, kv_heads, dim).transpose(1, 2)
            cos, sin = self.rotary(feature, positions)
            cos, sin = cos[:, None], sin[:, None]  # [1, 1, T, D]: over heads
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            keys.append(k)
            values.append(v)
            attended = ttt_attention(q, keys, values, causal, attn.scaling)
            out = feature + attn.o_proj(attended.transpose(1, 2).reshape(batch, length, heads * dim))
            out = self.carry(out + self.layer.mlp(self.layer.post_attention_layernorm(out)))
            outputs.append(out[:, : length - step])
            feature = out
        return outputs

    def unroll_masked(self, fused: torch.Tensor, input_ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """`unroll` as one head forward per step over a cache of the earlier steps' keys, under `ttt_mask`: the
        layer's own attention over every entry, most of them masked."""
        # transformers takes ~0.5 s to import: the trainer imports this module, and its checks of its inputs answer
        # before any model loads (as in mtptrain.target)
        from transformers import DynamicCache

        length = input_ids.shape[1] - 1
        cache = DynamicCache()
        outputs: list[torch.Tensor] = []
        feature = fused[:, :length]
        for step in range(min(steps, length)):
            tokens, positions = _step_inputs(input_ids, step)
            mask = ttt_mask(length, step, feature.dtype, feature.device)
            out = self.forward(feature, tokens, positions, cache, mask)
            outputs.append(out[:, : length - step])
            feature = out
        return outputs

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary, from a step's carried state (already normed with norm_output)."""
        return self.lm_head(predicted if self.norm_output else self.norm(predicted))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids as target ids."""
        return self.draft_to_target[draft_ids]

    @torch.no_grad()
    def target_tables(self, target_hidden: torch.Tensor, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
        """From one pass of the target's full LM head, `chunk` positions at a time: its greedy choice over the
        full vocabulary [...] (what acceptance will be scored against) and its logits over the draft
        vocabulary [..., N] (what the head is distilled towards). Every TTT step reads slices of these."""
        flat = target_hidden.reshape(-1, target_hidden.shape[-1])
        tops, logits = [], []
        for start in range(0, flat.shape[0], chunk):
            full = self.frozen.target_logits(flat[start:start + chunk])
            # max's indices: the same first maximum as argmax, which in bfloat16 (autocast) is 5x slower on CPU
            tops.append(full.max(-1).indices)
            logits.append(full[:, self.draft_to_target])
        shape = target_hidden.shape[:-1]
        return torch.cat(tops).reshape(shape), torch.cat(logits).reshape(*shape, len(self.draft_to_target))

    def target_logits(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The target's logits restricted to the draft vocabulary (only those rows of its LM head)."""
        weight = self.frozen.lm_head.weight
        rows = weight[self.draft_to_target.to(weight.device)]
        return (self.frozen.normed(target_hidden).to(weight.device) @ rows.T).to(target_hidden.device)


class Eagle3Drafting:
    """An EAGLE-3 head's operations around its layer while drafting, each a fused operation or two on copies of
    its weights in the stepper's dtype: the runtime's `rms_norm` for each RMSNorm module (one pass over a row where
    `F.rms_norm` takes five operations; torch's off the CPU), the fc norms
    folded into fc's columns (fc(cat(n_i(x_i) * g_i)) = (fc * cat(g_i))(cat(n_i(x_i)))), and fc on the stepper's
    product. Equal to the head's own up to float rounding (tests/heads/test_fast_step.py)."""

    def __init__(self, head: Eagle3Head, spec: HeadSettings, stepper: HeadStepper):
        dtype, device = stepper.dtype, stepper.device
        own = lambda norm: norm.weight.detach().to(device, dtype)  # noqa: E731
        self.layers = list(spec.feature_layers)
        self.eps = head.frozen.config.rms_norm_eps
        self.embed, self.dtype, self.device = head.frozen.embed.weight, dtype, device
        self.embed_norm, self.feature_norm = own(head.layer.input_layernorm), own(head.hidden_norm)
        self.output_norm = own(head.norm) if head.norm_output else None
        fc = head.fc.weight.detach().float()
        if head.fc_norm is not None:
            fc = fc * torch.cat([norm.weight.detach().float() for norm in head.fc_norm]).to(fc.device)[None]
        self.fc_norm = head.fc_norm is not None
        self.fc = stepper.lay_out(fc)

    def drafting(self) -> Drafting:
        return Drafting(self.inputs, self.draft_input, self.carry if self.output_norm is not None else None)

    def norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        return rms_norm(x, weight, self.eps)

    def draft_input(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """The fused step-0 feature [1, n, H] from the captured states (layer -> [n, H])."""
        # each layer's states moved first: a target split over GPUs holds them on the GPU of their layer
        states = torch.stack([hidden[layer].to(self.device, self.dtype) for layer in self.layers], dim=-2)
        if self.fc_norm:
            states = self.norm(states, None)
        return self.fc(states.reshape(1, states.shape[0], -1))

    def inputs(self, feature: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = F.embedding(ids.to(self.embed.device), self.embed).to(self.device, self.dtype)
        return torch.cat([self.norm(embeds, self.embed_norm), self.norm(feature, self.feature_norm)], dim=-1), feature

    def carry(self, out: torch.Tensor) -> torch.Tensor:
        return self.norm(out, self.output_norm)


# Draft vocabularies up to this size keep their logits for backward rather than computing them again: a chunk of
# 1024 positions holds 32 MB of float32 logits per 8192 tokens, and dropping the recompute took bf16-autocast
# training from 1,983 to 2,560 tokens/s on the quickstart recipe (benchmarks/train_throughput.py).
RECOMPUTE_ABOVE = 32768


def _step_inputs(input_ids: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TTT step `step`'s tokens x_{t+1+step} for t = 0 .. T-2 (zero-padded, so that every step's block has the
    same length and block i's column t is position t of step i) and their positions [1, T-1]."""
    length = input_ids.shape[1] - 1
    tokens = input_ids[:, 1 + step:]
    tokens = torch.cat([tokens, tokens.new_zeros(tokens.shape[0], step)], dim=1)
    return tokens, torch.arange(step, step + length, device=input_ids.device)[None]


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], causal: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """Attention of step j's queries q [B, H, T, D] over the keys and values [B, Hkv, T, D] of steps 0..j:
    causal over step 0, and over each later step only the query's own position. One softmax (float32 at least)
    over the T causal scores and the j diagonal ones; GQA by grouping the query heads of each key head.

    On CUDA this is `ttt_sdpa`: these products keep the float32 scores and the probabilities [B, H, T, T + j] for
    backward, 3 GiB per step at 4 x 2048 tokens and 32 heads (21 GiB over 7 steps, 84 GiB at 4096 tokens)."""
    if q.device.type == "cuda":
        return ttt_sdpa(q, keys, values, causal, scale)
    batch, heads, length, dim = q.shape
    kv_heads = keys[0].shape[1]
    grouped = q.view(batch, kv_heads, heads // kv_heads, length, dim)
    wide = torch.promote_types(q.dtype, torch.float32)  # the softmax in float32 at least
    scores = torch.matmul(grouped, keys[0][:, :, None].transpose(-1, -2)).to(wide) * scale
    scores = scores.masked_fill(~causal, float("-inf"))
    diagonal = [(grouped * k[:, :, None]).sum(-1).to(wide) * scale for k in keys[1:]]  # [B, Hkv, G, T] each
    if diagonal:
        scores = torch.cat([scores, torch.stack(diagonal, dim=-1)], dim=-1)
    probs = torch.softmax(scores, dim=-1).to(values[0].dtype)
    out = torch.matmul(probs[..., :length], values[0][:, :, None])
    for i, v in enumerate(values[1:]):
        out = out + probs[..., length + i, None] * v[:, :, None]
    return out.reshape(batch, heads, length, dim)


def ttt_sdpa(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], causal: torch.Tensor,
             scale: float) -> torch.Tensor:
    """`ttt_attention` as one SDPA call over the keys of steps 0..j laid end to end, under the mask of `ttt_mask`
    (each key-value head's query heads folded into its queries: the mem-efficient kernel takes a mask, not grouped
    heads). Of the scores' size only the mask is kept for backward, [G*T, (j + 1) T] in q's dtype and shared by the
    batch and the key-value heads (0.94 GB over 7 steps at 2048 tokens and G = 4), but every masked entry is
    computed: (j + 1) T keys per query at step j, 28 T against 7 T for 7 steps."""
    batch, heads, length, dim = q.shape
    kv_heads = keys[0].shape[1]
    diagonal = torch.eye(length, dtype=torch.bool, device=q.device)
    seen = torch.cat([causal] + [diagonal] * (len(keys) - 1), dim=1)[None, None]
    mask = folded_mask(seen, heads // kv_heads, q.dtype)
    out = F.scaled_dot_product_attention(q.reshape(batch, kv_heads, -1, dim), torch.cat(keys, dim=2),
                                         torch.cat(values, dim=2), attn_mask=mask, scale=scale)
    return out.reshape(batch, heads, length, dim)


def ttt_mask(length: int, step: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask [1, 1, T, (step+1)*T] for TTT step `step`: causal over step 0, diagonal over steps 1..step."""
    t = torch.arange(length, device=device)
    allowed = [t[None, :] <= t[:, None]] + [t[None, :] == t[:, None]] * step
    mask = torch.zeros(length, (step + 1) * length, dtype=dtype, device=device)
    return mask.masked_fill_(~torch.cat(allowed, dim=1), torch.finfo(dtype).min)[None, None]


class Eagle3Family(EagleStyleFamily):
    kind = "eagle3"
    export_formats = ("eagle3", "speculators")

    def settings(self, cfg, manifest):
        captured, last = manifest["layers"], manifest["last_layer"]
        features = [l for l in captured if l != last] if cfg.feature_layers == "auto" else list(cfg.feature_layers)
        if not features:
            raise HeadSettingsError(f"eagle3 fuses inner layers, but the store captured only {captured}: "
                                    "precompute with precompute.layers=eagle3 (or list the layers)")
        return {"feature_layers": features, "ttt_steps": cfg.ttt_steps,
                "draft_vocab_size": min(cfg.draft_vocab_size, manifest["target"]["vocab_size"]),
                "fc_norm": cfg.fc_norm, "norm_output": cfg.norm_output}

    def build(self, spec, frozen, vocab=None):
        if vocab is None:  # rebuilt from a checkpoint: the maps come with the weights
            vocab = DraftVocab.from_counts(Counter(), spec.draft_vocab_size, frozen.config.vocab_size)
        return Eagle3Head(frozen, vocab, num_features=len(spec.feature_layers), fc_norm=spec.fc_norm,
                          norm_output=spec.norm_output)

    def draft_vocab(self, spec, streams, target_vocab_size):
        """The training data's most frequent tokens."""
        return DraftVocab.from_token_streams(streams, spec.draft_vocab_size, target_vocab_size)

    def draft_positions(self, spec):
        return spec.ttt_steps

    def objective(self, head, batch, spec, weights, feature_weight, chunk, loss=Loss()):
        """Distillation at every TTT step, over the draft vocabulary, scored against the target's
        full-vocabulary choice. The choice comes from the store where precompute recorded it (`target_top`),
        and then only the draft vocabulary's rows of the LM head are multiplied; otherwise both come from one
        pass of the full LM head over the batch. Each step reads a shifted slice."""
        last = batch["hidden"][spec.last_layer]
        fused = head.fuse([batch["hidden"][layer] for layer in spec.feature_layers])
        outputs = head.unroll(fused, batch["input_ids"], spec.ttt_steps)
        if "target_top" in batch:  # the store holds the target's choices: only the draft vocabulary's rows
            with torch.no_grad():
                top, table = batch["target_top"], head.target_logits(last)
        else:
            top, table = head.target_tables(last, chunk)
        return distill_positions(outputs, [head.logits] * len(outputs), given, table, batch["loss_mask"], weights,
                                 chunk, to_target=head.to_target, target_top=top,
                                 recompute=len(head.draft_to_target) > RECOMPUTE_ABOVE, loss=loss)

    def draft_layers(self, spec):
        return list(spec.feature_layers)

    def reads(self, spec):
        return (f"fuses the outputs of layers {list(spec.feature_layers)} (0-based) and is matched to layer "
                f"{spec.last_layer}")

    def facts(self, spec):
        norms = [name for name, on in (("fc_norm", spec.fc_norm), ("norm_output", spec.norm_output)) if on]
        return [f"- {spec.ttt_steps} training-time-test steps, draft vocabulary {spec.draft_vocab_size} tokens",
                f"- EAGLE-3.1 norms: {', '.join(norms) if norms else 'none (EAGLE-3 placement)'}"]


EAGLE3 = Eagle3Family()
