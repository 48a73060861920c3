"""Compiler passes, one per file, each a pure function `ModelIR -> ModelIR`.

The registry maps each pass's CLI name (kebab-case) to its function; `mstarc.pipeline` runs
them in `PIPELINE` order and offers --verify-each, --print-after and --time-passes.
"""
