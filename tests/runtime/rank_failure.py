"""A trainer entry for torchrun whose rank 1 fails while writing its first checkpoint shards (fault
injection: a real failed rank cannot be produced on demand), otherwise `python -m onboard.train_cli`."""
from __future__ import annotations

import os
import sys

from runtime.train import checkpoint
from onboard.train_cli import main


def _failing_save(*args, **kwargs):
    raise RuntimeError("injected failure on rank 1 while saving")


if __name__ == "__main__":
    if os.environ["RANK"] == "1":
        checkpoint.dcp.save = _failing_save
    sys.exit(main())
