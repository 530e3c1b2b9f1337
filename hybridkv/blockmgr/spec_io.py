"""Model specs from files, now :mod:`hybridkv.models.spec_file` (hybridkv's format) and
:mod:`hybridkv.models.hf` (HuggingFace configs); this name keeps working."""

from hybridkv.models.hf import spec_from_hf_config  # noqa: F401
from hybridkv.models.spec_file import (  # noqa: F401
    MAX_LAYERS,
    is_spec_path,
    load_spec,
    read_spec_file,
    resolve_model,
    spec_from_dict,
)
