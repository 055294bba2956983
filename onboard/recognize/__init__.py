"""Manifest -> ModelSpec: recognition from config keys and weight names, checked against
transformers' own model on the meta device; what is not understood is kept as unrecognized."""
