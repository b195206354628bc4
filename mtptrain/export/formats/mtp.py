"""MTP heads as DeepSeek-V3 MTP layers: the target's extra layers model.layers.N .. N+m-1.

Each layer holds enorm, hnorm, eh_proj (columns [embedding | hidden]), the
block under the target layer's own names, shared_head.norm, and copies of the
target's embedding and LM head, as DeepSeek-V3's checkpoint carries them.
vLLM (deepseek_mtp) and SGLang (NextN) run such layers for DeepSeek-V3
architecture targets; for other targets the export is written, and read back
by mtptrain, but no engine serves it.
"""

from __future__ import annotations

from mtptrain.export.formats.base import Format, HeadToExport, Written, inverse, renamed
from mtptrain.export.sidecar import ExportError

SERVED_MODEL_TYPES = ("deepseek_v3", "deepseek_v32")  # what vLLM's and SGLang's MTP drafters accept
FIXED = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "embed_tokens.weight",
         "shared_head.head.weight")


def mtp_names(layer_names: list[str], n_layers: int, modules: int) -> dict[str, str]:
    """Our names -> DeepSeek's for `modules` MTP modules whose decoder layers hold `layer_names`."""
    names = {}
    for i in range(modules):
        ours, theirs = f"blocks.{i}.", f"model.layers.{n_layers + i}."
        names[f"{ours}norm_embed.weight"] = f"{theirs}enorm.weight"
        names[f"{ours}norm_hidden.weight"] = f"{theirs}hnorm.weight"
        names[f"{ours}proj.weight"] = f"{theirs}eh_proj.weight"
        names[f"head_norms.{i}.weight"] = f"{theirs}shared_head.norm.weight"
        names.update({f"{ours}layer.{name}": theirs + name for name in layer_names})
    return names


class DeepSeekMTP(Format):
    name = "deepseek-mtp"
    title = "DeepSeek-V3 style MTP layers"

    def check(self, src, cfg):
        super().check(src, cfg)
        if src.spec.norms != "restored":
            raise ExportError("this mtp head has its norms stripped; a DeepSeek MTP layer always applies enorm, "
                              "hnorm and shared_head.norm. Train with head.norms=restored to export as deepseek-mtp.")
        if src.spec.mtp_input != "normed":
            raise ExportError("this mtp head reads the target's pre-norm states (head.mtp_input=raw); vLLM and SGLang "
                              "hand an MTP layer the target's final-normed states. Train with head.mtp_input=normed "
                              "(the default) to export as deepseek-mtp.")

    def modules(self, src: HeadToExport) -> int:
        return 1 if src.spec.mtp_share else src.spec.mtp_depths

    def write(self, src, cfg):
        n, modules = src.target_config["num_hidden_layers"], self.modules(src)
        layer_names = sorted({k.split(".layer.", 1)[1] for k in src.state if k.startswith("blocks.0.layer.")})
        tensors = renamed(src.state, mtp_names(layer_names, n, modules))
        embed = src.target_tensor("model.embed_tokens.weight").to(src.float_dtype)
        head = src.target_tensor("lm_head.weight", "model.embed_tokens.weight").to(src.float_dtype)
        for i in range(modules):  # the target's own, as DeepSeek's checkpoints carry them in every MTP layer
            tensors[f"model.layers.{n + i}.embed_tokens.weight"] = embed.clone()
            tensors[f"model.layers.{n + i}.shared_head.head.weight"] = head.clone()
        config = {**src.target_config_json(), "num_nextn_predict_layers": modules}
        notes = [f"{modules} MTP layer(s) at model.layers.{n}..{n + modules - 1} after the target's {n} layers; "
                 f"the head drafts {src.spec.mtp_depths} token(s)"
                 + (" reusing its one layer at every depth" if src.spec.mtp_share and src.spec.mtp_depths > 1 else ""),
                 "eh_proj columns: [embedding | hidden]; depth 1 reads the target's final-normed state",
                 "embed_tokens and shared_head.head are copies of the target's (engines may take the target's)",
                 "config.json is the target's own, plus num_nextn_predict_layers"]
        if modules > 1:
            notes.append("SGLang loads exactly one MTP layer (num_nextn_predict_layers 1): train with "
                         "head.mtp_share=true or head.mtp_depths=1 for SGLang; vLLM loads several")
        model_type = src.target_config.get("model_type")
        if model_type not in SERVED_MODEL_TYPES:
            notes.append(f"the target is a {model_type} model: vLLM and SGLang run MTP layers for "
                         f"{' / '.join(SERVED_MODEL_TYPES)} targets only, so no engine serves this export; "
                         "mtptrain eval and stitch read it")
        return Written(tensors, config, notes)

    def to_head(self, tensors, sidecar):
        spec = sidecar["head_config"]["head"]
        n = sidecar["num_hidden_layers"]
        prefix = f"model.layers.{n}."
        layer_names = [k[len(prefix):] for k in tensors if k.startswith(prefix) and k[len(prefix):] not in FIXED]
        return inverse(tensors, mtp_names(layer_names, n, 1 if spec["mtp_share"] else spec["mtp_depths"]))

    def serve(self, out, target, sidecar):
        if sidecar["head_config"]["target"].get("model_type") not in SERVED_MODEL_TYPES:
            return []
        depths = sidecar["head_config"]["head"]["mtp_depths"]
        return [
            ("SGLang", f"python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE "
                       f"--speculative-draft-model-path {out} --speculative-num-steps {depths} "
                       f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {depths + 1}"),
            ("vLLM", f"vllm serve {target} --speculative-config "
                     f"'{{\"method\": \"deepseek_mtp\", \"model\": \"{out}\", \"num_speculative_tokens\": {depths}}}'"),
            ("vLLM, one directory", f"mtptrain stitch {out} --target {target} --out STITCHED && vllm serve STITCHED "
                                    f"--speculative-config '{{\"method\": \"deepseek_mtp\", "
                                    f"\"num_speculative_tokens\": {depths}}}'"),
        ]
