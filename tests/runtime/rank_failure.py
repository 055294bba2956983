"""A trainer entry for torchrun whose rank 1 fails while writing its first checkpoint shards (fault
injection: a real failed rank cannot be produced on demand), otherwise `python -m onboard.commands.train`."""
from __future__ import annotations

import os
import sys

from onboard.commands.train import main
from runtime.train import checkpoint


def _failing_save(*args, **kwargs):
    raise RuntimeError("injected failure on rank 1 while saving")


if __name__ == "__main__":
    if os.environ["RANK"] == "1":
        checkpoint.dcp.save = _failing_save
    sys.exit(main())
