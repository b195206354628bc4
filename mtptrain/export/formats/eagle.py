"""EAGLE-1/2 heads as the official EAGLE code and SGLang's LlamaForCausalLMEagle read them.

The format holds the original EAGLE placement only (head.norms=stripped): fc
(with a bias) over [embedding ; feature], one Llama layer without an input
norm, no final norm; the target's LM head reads the output, and the feature is
the target's final-normed last-layer state.
"""

from __future__ import annotations

from mtptrain.export.formats.base import (LLAMA_LAYER, Format, Written, check_llama_layer, draft_llama_config,
                                          inverse, renamed)
from mtptrain.export.sidecar import ExportError

EAGLE_LAYER = tuple(s for s in LLAMA_LAYER if s != "input_layernorm.weight")


def eagle_names() -> dict[str, str]:
    names = {"block.proj.weight": "fc.weight", "block.proj.bias": "fc.bias"}
    names.update({f"block.layer.{s}": f"layers.0.{s}" for s in EAGLE_LAYER})
    return names


class Eagle(Format):
    name = "eagle"
    title = "EAGLE-1/2 draft for the official EAGLE code and SGLang"

    def check(self, src, cfg):
        super().check(src, cfg)
        if src.spec.norms != "stripped":
            raise ExportError(
                "this eagle head has its RMSNorms restored (norms on the embedding and the feature, the layer's "
                "input norm, a final norm) and reads the target's pre-norm states; the EAGLE-1/2 format has none "
                "of those norms and feeds the target's final-normed states. Train with head.norms=stripped to "
                "export as eagle.")
        check_llama_layer(src, "block.layer.", EAGLE_LAYER, self.name)

    def write(self, src, cfg):
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
