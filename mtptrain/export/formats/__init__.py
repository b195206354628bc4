"""The export formats: how each names a head's tensors, what its config says, what it cannot express.

Every fact here is listed, with the source it was read from, in the format's
table under mtptrain/export/specs/; each export is checked against it.

    eagle3        EAGLE-3 draft directory that SGLang (LlamaForCausalLMEagle3) and vLLM
                  (Eagle3LlamaForCausalLM) both load as a draft model          (eagle3.py)
    speculators   vLLM's speculators format: `vllm serve <dir>` alone         (eagle3.py)
    eagle         EAGLE-1/2 draft as the official EAGLE code and SGLang read it (eagle.py)
    deepseek-mtp  DeepSeek-V3 MTP layers named as the target's extra layers    (mtp.py)
"""

from mtptrain.export.formats.base import Format, Written
from mtptrain.export.formats.eagle import Eagle
from mtptrain.export.formats.eagle3 import Eagle3, Speculators
from mtptrain.export.formats.mtp import DeepSeekMTP

FORMATS: dict[str, Format] = {f.name: f for f in (Eagle3(), Speculators(), Eagle(), DeepSeekMTP())}

__all__ = ["FORMATS", "Format", "Written"]
