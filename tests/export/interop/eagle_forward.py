"""Runs the official EAGLE-1/2 draft model (eagle-llm from PyPI, imported from the unpacked wheel) on one of our
eagle exports.

    python eagle_forward.py EAGLE_DIR EXPORT_DIR VERIFIER_DIR INPUTS.safetensors OUT.safetensors

INPUTS holds hidden_states [1, T, H] (the target's final-normed last-layer states) and input_ids [1, T] (the
token after each position). OUT gets the draft's output states (hidden, [T, H]). The weights are loaded as
eagle/model/ea_model.py loads them: load_state_dict(strict=False) over a Model whose embedding is the target's.
"""

import sys

eagle_dir, export_dir, verifier_dir, inputs, out = sys.argv[1:6]
sys.path.insert(0, eagle_dir)

import torch  # noqa: E402
from eagle.model.cnets import Model  # noqa: E402
from eagle.model.configs import EConfig  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

config = EConfig.from_pretrained(export_dir)
# eagle-llm 1.2.1 predates transformers 5, which fills rope_scaling from rope_parameters; the export writes
# rope_scaling null, which that code reads as "no scaling".
config.rope_scaling = None
model = Model(config, load_emb=False, bias=config.bias).eval()
# load_emb=True reads the embedding from a sharded checkpoint index; this verifier is one file, so copy it.
model.embed_tokens.weight.data = AutoModelForCausalLM.from_pretrained(verifier_dir).get_input_embeddings().weight.data
missing, unexpected = model.load_state_dict(load_file(f"{export_dir}/model.safetensors"), strict=False)
if missing != ["embed_tokens.weight"] or unexpected:
    sys.exit(f"eagle-llm did not load the export as expected: missing {missing}, unexpected {unexpected}")
x = load_file(inputs)
with torch.no_grad():
    state = model(x["hidden_states"], x["input_ids"])
save_file({"hidden": state[0].contiguous()}, out)
