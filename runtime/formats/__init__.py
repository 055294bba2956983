"""Stored weight formats of released checkpoints (FP8 block-scaled, MXFP4): decode and encode."""
