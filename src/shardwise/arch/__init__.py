"""Decoder-only Transformer architectures (SPEC §1): `ModelSpec` and its counts (`spec`,
`counts`), the presets (`presets`), Hugging Face `config.json` reading (`hf_fields`: what each
field does per model_type; `hf`: the readers). The formulas: docs/concepts/model.md."""

from shardwise.arch.counts import ParamCount
from shardwise.arch.hf import READERS, from_hf_config, from_hf_dict
from shardwise.arch.hf_fields import _HF_IGNORED, HF_FIELDS, SUPPORTED_HF_TYPES, HFFields
from shardwise.arch.presets import DEFAULT_MODEL, PRESETS, get_model
from shardwise.arch.spec import ModelSpec, count_params

__all__ = [
           "DEFAULT_MODEL",
           "HF_FIELDS",
           "PRESETS",
           "READERS",
           "SUPPORTED_HF_TYPES",
           "_HF_IGNORED",
           "HFFields",
           "ModelSpec",
           "ParamCount",
           "count_params",
           "from_hf_config",
           "from_hf_dict",
           "get_model",
]
