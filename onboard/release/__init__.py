"""The release folder as it is on disk: config.json checked, safetensors headers read (never tensor
data), tensor naming, and which transformers class and source the release loads with."""
