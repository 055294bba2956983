"""A tiny custom-code release of Kimi K3's shape: its writer (writer.py), and the release's own configuration and
modeling files (release_code/), copied beside the weights as package data and never imported by onboard itself
(the weights are written by them in a subprocess)."""
