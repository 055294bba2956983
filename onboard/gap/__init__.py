"""ModelSpec -> GapReport: each component against the operator registry, the weight check and the memory
budget; its Markdown and terminal renderings."""
