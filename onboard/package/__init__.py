"""The trainable package on disk: written atomically (writer), read and validated (files), its weight
map, the PEFT export, the CI workflow and the git commit."""
