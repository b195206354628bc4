"""Runs SpecForge's LlamaForCausalLMEagle3 (imported from the unpacked wheel) on one of our eagle3 exports.

    python specforge_forward.py SPECFORGE_DIR EXPORT_DIR VERIFIER_DIR INPUTS.safetensors OUT.safetensors

INPUTS as for speculators_forward.py. OUT gets the draft's first-step output state (hidden, [T, H]) and
logits over the draft vocabulary (logits, [T, Vd]). The draft is loaded the way SpecForge's own
export/checkpoint_io.py (materialize_draft) loads one: built from the config, load_state_dict(strict=False)
with only the embedding allowed to be missing (float32 here, to compare closely), then the embedding from the
verifier with load_embedding. (Loaded with its from_pretrained under transformers 5.23, the same export gave
NaN outputs.)
"""

import sys

specforge_dir, export_dir, verifier_dir, inputs, out = sys.argv[1:6]
sys.path.insert(0, specforge_dir)

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

config = LlamaConfig.from_pretrained(export_dir)
# SpecForge reads norm_output as "apply the final norm before the LM head" (default true); vLLM and speculators
# read the same key as "feed the normed state to the next step", which is what the export writes (false).
config.norm_output = True
model = LlamaForCausalLMEagle3(config).eval()
missing, unexpected = model.load_state_dict(load_file(f"{export_dir}/model.safetensors"), strict=False)
if missing != ["embed_tokens.weight"] or unexpected:
    sys.exit(f"SpecForge did not load the export as expected: missing {missing}, unexpected {unexpected}")
model.load_embedding(verifier_dir)
x = load_file(inputs)
ids, feats = x["input_ids"], x["hidden_states"]
length = ids.shape[1]
with torch.no_grad():
    embeds = model.embed_input_ids(ids)
    hidden = model.project_hidden_states(feats)
    mask = model.prepare_decoder_attention_mask(attention_mask=torch.ones_like(ids, dtype=torch.bool),
                                                hidden_states=hidden, batch_size=1, seq_length=length,
                                                past_key_values_length=0)
    state = model.backbone(input_embeds=embeds, hidden_states=hidden, cache_hidden=None, attention_mask=mask,
                           position_ids=torch.arange(length)[None], past_key_values=None, use_cache=False)
    logits = model.compute_logits(state)
save_file({"hidden": state[0].contiguous(), "logits": logits[0].contiguous()}, out)
