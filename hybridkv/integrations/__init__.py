"""Adapters between hybridkv and engines or frameworks written by others.

- :mod:`hybridkv.integrations.transformers`: serve an unmodified HuggingFace transformers hybrid model
  through hybridkv's scheduler and paged pools (``pip install 'hybridkv[hf]'``).

Arrows go down: this package may import anything in hybridkv; nothing in hybridkv imports it.
"""
