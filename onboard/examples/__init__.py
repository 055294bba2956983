"""Tiny random-weight releases of real families, written by transformers, and their tokenizer."""

# The weight formats `example-model --weights` writes: bf16, or a stored format a family's real release ships
# (onboard/examples/stored.py says which)
WEIGHT_FORMATS = ("bf16", "fp8", "mxfp4")
