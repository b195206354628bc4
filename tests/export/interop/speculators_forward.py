"""Runs vLLM's speculators package (in its own environment) on one of our speculators-format exports.

    python speculators_forward.py EXPORT_DIR INPUTS.safetensors OUT.safetensors TTT_STEPS

INPUTS holds hidden_states [1, T, 3H] (the verifier's captured layers, concatenated) and input_ids [1, T]
(the token after each position). OUT gets the draft model's logits of every training-time-test step
(logits.<k>, [T, Vd]), its argmax draft ids (draft.<k>) and its d2t map. The model is loaded with
SpeculatorModel.from_pretrained, which also loads the verifier named in the export's config.
"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from speculators import SpeculatorModel  # noqa: E402

export_dir, inputs, out, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
model = SpeculatorModel.from_pretrained(export_dir, dtype=torch.float32).eval()
x = load_file(inputs)
logits: list[torch.Tensor] = []
hook = model.lm_head.register_forward_hook(lambda module, args, output: logits.append(output.detach().clone()))
with torch.no_grad():
    drafts = model(hidden_states=x["hidden_states"], input_ids=x["input_ids"],
                   document_ids=torch.zeros_like(x["input_ids"]), ttt_steps=steps)
hook.remove()
tensors = {f"logits.{k}": t[0].contiguous() for k, t in enumerate(logits)}
tensors |= {f"draft.{k}": d[0].contiguous() for k, d in enumerate(drafts)}
tensors["d2t"] = model.d2t.detach().clone().contiguous()
tensors["attention"] = torch.tensor([ord(c) for c in model.config.transformer_layer_config._attn_implementation])
save_file(tensors, out)
