"""Tiny random-weight releases of real families, written by transformers, and their tokenizer."""
