"""The files the example release ships (config.json's auto_map names them). Imported only by build.py, which the
writer runs in a subprocess."""
