"""mstarc: the M* compiler. `.walk` source + placement YAML -> checked, deterministic plan file.

The compiler never imports torch (tests/test_imports.py enforces it): it computes everything
it needs (weight shapes, KV geometry, memory) from the model's config and the architecture
catalogue in `mstarc.archs`.
"""

__version__ = "0.1.0"
