"""The target model: where it comes from (source.py), reading it in parts (parts.py), loading it (loading.py),
and the fingerprints that recognise it later (fingerprint.py)."""

from mtptrain.target.fingerprint import (
    ARCHITECTURE_FIELDS, checkpoint_fingerprint, compared_fields, identity_mismatch, model_fingerprint,
    tokenizer_fingerprint,
)
from mtptrain.target.loading import (
    Target, load_frozen_target, load_identified_parts, load_target, load_tokenizer, rank_devices, split_device_map,
)
from mtptrain.target.parts import frozen_parameters, load_config, read_weight_map
from mtptrain.target.source import TargetError, embedded_gguf_path, resolve_local_dir

__all__ = [
    "ARCHITECTURE_FIELDS", "Target", "TargetError", "checkpoint_fingerprint", "compared_fields", "embedded_gguf_path",
    "frozen_parameters", "identity_mismatch", "load_config", "load_frozen_target", "load_identified_parts",
    "load_target", "load_tokenizer", "model_fingerprint", "rank_devices", "read_weight_map", "resolve_local_dir",
    "split_device_map", "tokenizer_fingerprint",
]
