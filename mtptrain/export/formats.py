"""The export formats: how each names a head's tensors, what its config says, what it cannot express.

Every fact here is listed, with the source it was read from, in the format's
table under mtptrain/export/specs/; tests/export checks each export against it.

    eagle3        EAGLE-3 draft directory that SGLang (LlamaForCausalLMEagle3) and vLLM
                  (Eagle3LlamaForCausalLM) both load as a draft model
    speculators   vLLM's speculators format: `vllm serve <dir>` alone starts target + draft
    eagle         EAGLE-1/2 draft as the official EAGLE code and SGLang (LlamaForCausalLMEagle) read it
    deepseek-mtp  DeepSeek-V3 style MTP layers named as the target's extra layers; `mtptrain stitch`
                  writes them into a copy of the target checkpoint

Layer numbering. Our feature layer j is the output of the target's 0-based
decoder layer j. vLLM (and speculators) capture the residual stream *before*
layer i, so they write i = j + 1, at the top level of the config. SGLang reads
a nested eagle_config and adds 1 itself, so it wants j, except that since
sglang PR #25454 it adds 1 only when the first id is 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mtptrain.export.source import ExportError, HeadSource

# A Llama decoder layer's tensors (no biases, no q/k norms): the layer every EAGLE format's draft is built of.
LLAMA_LAYER = ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
               "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
               "mlp.down_proj.weight", "post_attention_layernorm.weight")
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose schema the speculators export follows


@dataclass
class Options:
    verifier: str | None = None  # speculators: the target as the server loads it (hub id or directory)
    sglang_ids: str = "auto"  # eagle3: "auto", "before-25454" or "since-25454"
    speculative_tokens: int = 3  # speculators: the proposal's draft length


@dataclass
class Written:
    tensors: dict[str, torch.Tensor]
    config: dict
    notes: list[str] = field(default_factory=list)  # facts the README spells out


class Format:
    name = ""
    title = ""
    kinds: tuple[str, ...] = ()

    def check(self, src: HeadSource, options: Options) -> None:
        if src.spec.kind not in self.kinds:
            fits = [f.name for f in FORMATS.values() if src.spec.kind in f.kinds]
            raise ExportError(f"a {src.spec.kind} head cannot be exported as {self.name} ({self.title}), which "
                              f"holds {' or '.join(self.kinds)} heads only; formats for {src.spec.kind} heads: "
                              f"{', '.join(fits) or 'none'}")

    def write(self, src: HeadSource, options: Options) -> Written:
        raise NotImplementedError

    def to_head(self, tensors: dict[str, torch.Tensor], sidecar: dict) -> dict[str, torch.Tensor]:
        """The inverse of write: the export's tensors under the head's own names."""
        raise NotImplementedError

    def serve(self, out: str, target: str, sidecar: dict) -> list[tuple[str, str]]:
        raise NotImplementedError


# --------------------------------------------------------------------------- shared pieces


def draft_llama_config(src: HeadSource) -> dict:
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


def check_llama_layer(src: HeadSource, prefix: str, expected: tuple[str, ...], fmt: str) -> None:
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


# --------------------------------------------------------------------------- EAGLE-3


def eagle3_names(layer_prefix: str) -> dict[str, str]:
    names = {"fc.weight": "fc.weight", "hidden_norm.weight": f"{layer_prefix}hidden_norm.weight",
             "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight"}
    names.update({f"layer.{s}": f"{layer_prefix}{s}" for s in LLAMA_LAYER})
    return names


def vocab_maps(src: HeadSource) -> dict[str, torch.Tensor]:
    """d2t: int64 [Vd], target id = i + d2t[i]; t2d: bool [V], whether a target token is in the draft vocabulary."""
    draft_to_target = src.state["draft_to_target"].long()
    return {"d2t": draft_to_target - torch.arange(len(draft_to_target)),
            "t2d": src.state["target_to_draft"] >= 0}


def vocab_from_maps(d2t: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor]:
    draft_to_target = d2t.long() + torch.arange(len(d2t))
    target_to_draft = torch.full((vocab_size,), -1, dtype=torch.long)
    target_to_draft[draft_to_target] = torch.arange(len(d2t))
    return {"draft_to_target": draft_to_target, "target_to_draft": target_to_draft}


def aux_layer_ids(src: HeadSource, options: Options) -> tuple[list[int], list[int]]:
    """(vLLM / speculators ids, SGLang ids) for the head's feature layers."""
    layers = list(src.spec.feature_layers)
    n = src.target_config["num_hidden_layers"]
    if len(set(layers)) != len(layers) or layers != sorted(layers):
        raise ExportError(f"feature layers {layers} repeat a layer or are out of order: engines capture each layer "
                          "once, in ascending order, so the fc input would not match")
    if max(layers) > n - 2:
        raise ExportError(f"feature layer {max(layers)} is the target's last layer (of {n}): engines capture the "
                          "residual stream before a layer, so the last layer's output is never captured; train "
                          f"with feature layers up to {n - 2}")
    vllm = [j + 1 for j in layers]
    if options.sglang_ids == "before-25454":
        sglang = layers
    elif options.sglang_ids == "since-25454":
        sglang = layers if layers[0] == 1 else vllm
    elif layers[0] == 1:
        sglang = layers  # read the same by every SGLang version: the first id is 1, so 1 is added
    else:
        raise ExportError(
            f"feature layers {layers} do not start at layer 1: SGLang adds 1 to the ids it reads, but since "
            "sglang PR #25454 only when the first id is 1, so these ids name different layers in older and newer "
            "SGLang. Pass --sglang-ids before-25454 or since-25454 for the SGLang you serve with, or train with "
            "feature layers starting at 1 (the default).")
    return vllm, sglang


class Eagle3(Format):
    name = "eagle3"
    title = "EAGLE-3 draft for SGLang and vLLM"
    kinds = ("eagle3",)
    layer_prefix = "midlayer."

    def check(self, src, options):
        super().check(src, options)
        check_llama_layer(src, "layer.", LLAMA_LAYER, self.name)
        aux_layer_ids(src, options)

    def write(self, src, options):
        vllm_ids, sglang_ids = aux_layer_ids(src, options)
        tensors = renamed(src.state, eagle3_names(self.layer_prefix)) | vocab_maps(src)
        config = {
            "architectures": ["LlamaForCausalLMEagle3"],
            **draft_llama_config(src),
            "draft_vocab_size": src.spec.draft_vocab_size,
            "target_hidden_size": src.target_config["hidden_size"],
            "eagle_aux_hidden_state_layer_ids": vllm_ids,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_ids, "use_aux_hidden_state": True},
            "num_aux_hidden_states": len(vllm_ids),
            "bias": False,
            "norm_before_residual": False,
            "norm_before_fc": False,
            "fc_norm": False,
            "norm_output": False,
        }
        notes = [f"feature layers (0-based outputs) {src.spec.feature_layers}: vLLM ids {vllm_ids} "
                 f"(top-level eagle_aux_hidden_state_layer_ids), SGLang ids {sglang_ids} "
                 "(eagle_config.eagle_aux_hidden_state_layer_ids)",
                 "no embedding: both engines use the target's own",
                 "norm flags: norm_before_residual, norm_before_fc, fc_norm, norm_output all false (the residual "
                 "is the un-normed fc output; one hidden_norm on the feature, input_layernorm on the embedding; "
                 "the next step reads the pre-norm output)",
                 "SpecForge reads norm_output otherwise (the final norm before its LM head, default true): set it "
                 "true to load this directory into SpecForge's LlamaForCausalLMEagle3"]
        return Written(tensors, config, notes)

    def to_head(self, tensors, sidecar):
        state = inverse(tensors, eagle3_names(self.layer_prefix))
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


class Speculators(Eagle3):
    name = "speculators"
    title = "vLLM speculators format (EAGLE-3)"
    layer_prefix = "layers.0."

    def write(self, src, options):
        vllm_ids, _ = aux_layer_ids(src, options)
        verifier = options.verifier or src.served_target()
        tensors = renamed(src.state, eagle3_names(self.layer_prefix)) | vocab_maps(src)
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
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": options.speculative_tokens,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier,
                             "architectures": list(src.target_config.get("architectures") or [])},
            },
            "transformer_layer_config": layer,
            "draft_vocab_size": src.spec.draft_vocab_size,
            "target_hidden_size": src.target_config["hidden_size"],
            "eagle_aux_hidden_state_layer_ids": vllm_ids,
            "norm_before_residual": False,
            "norm_before_fc": False,
            "fc_norm": False,
            "norm_output": False,
            "embed_requires_grad": False,
            "torch_dtype": layer["torch_dtype"],
        }
        notes = [f"verifier: {verifier} (vllm serve loads it as the target; it must resolve on the serving machine)",
                 f"feature layers (0-based outputs) {src.spec.feature_layers}: eagle_aux_hidden_state_layer_ids "
                 f"{vllm_ids}",
                 "no top-level model_type: vLLM recognises the format by speculators_config",
                 "embed_tokens is the target's own embedding: speculators needs it in the file; vLLM shares the "
                 "target's when they are equal",
                 "norm flags: norm_before_residual false (vLLM assumes true when it is missing), norm_before_fc, "
                 "fc_norm, norm_output false"]
        return Written(tensors, config, notes)

    def serve(self, out, target, sidecar):
        return [("vLLM", f"vllm serve {out}")]


# --------------------------------------------------------------------------- EAGLE-1/2


EAGLE_LAYER = tuple(s for s in LLAMA_LAYER if s != "input_layernorm.weight")


def eagle_names() -> dict[str, str]:
    names = {"block.proj.weight": "fc.weight", "block.proj.bias": "fc.bias"}
    names.update({f"block.layer.{s}": f"layers.0.{s}" for s in EAGLE_LAYER})
    return names


class Eagle(Format):
    name = "eagle"
    title = "EAGLE-1/2 draft for the official EAGLE code and SGLang"
    kinds = ("eagle",)

    def check(self, src, options):
        super().check(src, options)
        if src.spec.norms != "stripped":
            raise ExportError(
                "this eagle head has its RMSNorms restored (norms on the embedding and the feature, the layer's "
                "input norm, a final norm) and reads the target's pre-norm states; the EAGLE-1/2 format has none "
                "of those norms and feeds the target's final-normed states. Train with head.norms=stripped to "
                "export as eagle.")
        check_llama_layer(src, "block.layer.", EAGLE_LAYER, self.name)

    def write(self, src, options):
        config = {"architectures": ["LlamaForCausalLMEagle"], **draft_llama_config(src), "bias": True}
        notes = ["fc carries a bias (config bias: true): SGLang's LlamaForCausalLMEagle always has one and the "
                 "official code reads the flag",
                 "no input norm on layer 0, no final norm, no LM head, no embedding: the target's own LM head and "
                 "embedding are used, on the target's final-normed states",
                 "vLLM's EAGLE-1 drafter has no fc bias and does not load this layout"]
        if config["rope_theta"] != 10000:
            notes.append(f"rope_theta {config['rope_theta']:g}: the official repository reads it, but eagle-llm 1.2.1 "
                         "on PyPI fixes the rotary base at 10000; serve with the repository's code or SGLang")
        return Written(renamed(src.state, eagle_names()), config, notes)

    def to_head(self, tensors, sidecar):
        return inverse(tensors, eagle_names())

    def serve(self, out, target, sidecar):
        return [
            ("SGLang", f"python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE "
                       f"--speculative-draft-model-path {out} --speculative-num-steps 3 --speculative-eagle-topk 1 "
                       "--speculative-num-draft-tokens 4"),
            ("official EAGLE", f"EaModel.from_pretrained(base_model_path=\"{target}\", ea_model_path=\"{out}\", "
                               "use_eagle3=False)"),
        ]


# --------------------------------------------------------------------------- DeepSeek MTP


def mtp_names(src_state: dict, n_layers: int, modules: int) -> dict[str, str]:
    names = {}
    for i in range(modules):
        ours, theirs = f"blocks.{i}.", f"model.layers.{n_layers + i}."
        names[f"{ours}norm_embed.weight"] = f"{theirs}enorm.weight"
        names[f"{ours}norm_hidden.weight"] = f"{theirs}hnorm.weight"
        names[f"{ours}proj.weight"] = f"{theirs}eh_proj.weight"
        names[f"head_norms.{i}.weight"] = f"{theirs}shared_head.norm.weight"
        for key in src_state:
            if key.startswith(f"{ours}layer."):
                names[key] = theirs + key[len(f"{ours}layer."):]
    return names


class DeepSeekMTP(Format):
    name = "deepseek-mtp"
    title = "DeepSeek-V3 style MTP layers"
    kinds = ("mtp",)

    def check(self, src, options):
        super().check(src, options)
        if src.spec.norms != "restored":
            raise ExportError("this mtp head has its norms stripped; a DeepSeek MTP layer always applies enorm, "
                              "hnorm and shared_head.norm. Train with head.norms=restored to export as deepseek-mtp.")
        if src.spec.mtp_input != "normed":
            raise ExportError("this mtp head reads the target's pre-norm states (head.mtp_input=raw); vLLM and SGLang "
                              "hand an MTP layer the target's final-normed states. Train with head.mtp_input=normed "
                              "(the default) to export as deepseek-mtp.")
        if "proj.bias" in "".join(src.state):
            raise ExportError("the head's fusion projection has a bias; DeepSeek's eh_proj has none")

    def modules(self, src: HeadSource) -> int:
        return 1 if src.spec.mtp_share else src.spec.mtp_depths

    def write(self, src, options):
        n, modules = src.target_config["num_hidden_layers"], self.modules(src)
        tensors = renamed(src.state, mtp_names(src.state, n, modules))
        embed = src.target_tensor("model.embed_tokens.weight").to(src.float_dtype)
        head = src.target_tensor("lm_head.weight", "model.embed_tokens.weight").to(src.float_dtype)
        for i in range(modules):  # the target's own, as DeepSeek's checkpoints carry them in every MTP layer
            tensors[f"model.layers.{n + i}.embed_tokens.weight"] = embed.clone()
            tensors[f"model.layers.{n + i}.shared_head.head.weight"] = head.clone()
        config = {**src.target_config_file, "num_nextn_predict_layers": modules,
                  "torch_dtype": str(src.float_dtype).removeprefix("torch.")}
        config.pop("dtype", None)
        notes = [f"{modules} MTP layer(s) at model.layers.{n}..{n + modules - 1} after the target's {n} layers; "
                 f"the head drafts {src.spec.mtp_depths} token(s)"
                 + (" reusing its one layer at every depth" if src.spec.mtp_share and src.spec.mtp_depths > 1 else ""),
                 "eh_proj columns: [embedding | hidden]; depth 1 reads the target's final-normed state",
                 "embed_tokens and shared_head.head are copies of the target's (engines may take the target's)"]
        if modules > 1:
            notes.append("SGLang loads exactly one MTP layer (num_nextn_predict_layers 1): train with "
                         "head.mtp_share=true or head.mtp_depths=1 for SGLang; vLLM loads several")
        return Written(tensors, config, notes)

    def to_head(self, tensors, sidecar):
        head_config = sidecar["head_config"]
        n = sidecar["num_hidden_layers"]
        layer_keys = [k for k in tensors if k.startswith(f"model.layers.{n}.")]
        spec = head_config["head"]
        modules = 1 if spec["mtp_share"] else spec["mtp_depths"]
        fixed = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "embed_tokens.weight", "shared_head.head.weight"}
        ours = {f"blocks.{i}.layer.{k.split('.', 3)[3]}": None for i in range(modules) for k in layer_keys
                if k.split(".", 3)[3] not in fixed}
        return inverse(tensors, mtp_names(ours, n, modules))

    def serve(self, out, target, sidecar):
        return [
            ("SGLang", f"python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE "
                       f"--speculative-draft-model-path {out} --speculative-num-steps 1 --speculative-eagle-topk 1 "
                       "--speculative-num-draft-tokens 2"),
            ("vLLM", f"vllm serve {target} --speculative-config "
                     f"'{{\"method\": \"deepseek_mtp\", \"model\": \"{out}\", \"num_speculative_tokens\": 1}}'"),
            ("vLLM, stitched", f"mtptrain stitch {out} --target {target} --out STITCHED && vllm serve STITCHED "
                               "--speculative-config '{\"method\": \"deepseek_mtp\", \"num_speculative_tokens\": 1}'"),
        ]


FORMATS: dict[str, Format] = {f.name: f for f in (Eagle3(), Speculators(), Eagle(), DeepSeekMTP())}
