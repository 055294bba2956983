"""Inside the sandbox (onboard/align/confined.py starts it): align a package with all its op files loaded, the
report or the refusal into the work folder beside the request. Confinement is what lets it run unapproved code."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from onboard.align.confined import REFUSAL, REPORT
from onboard.align.progress import Progress
from onboard.align.runner import align_in_process
from onboard.errors import BadInput
from onboard.exit_codes import Exit
from onboard.package.reader import read_package
from onboard.plan.search import Cluster
from runtime.errors import PackageOpRefused
from runtime.package_ops import read_op_files
from runtime.parallel.placement import MeshShape


def child_main(request_path: Path) -> Exit:
    """Align with every op file loaded; the report or the refusal into the request's folder."""
    request, work = json.loads(request_path.read_text()), request_path.parent
    pkg = Path(request["pkg"])
    cluster = Cluster(**request["cluster"]) if request["cluster"] else None
    mesh = MeshShape(**request["mesh"]) if request["mesh"] else None
    progress = Progress(lambda line: print(line, file=sys.stderr, flush=True))
    try:
        report = align_in_process(pkg, read_package(pkg, Path(request["model_dir"])), read_op_files(pkg),
                                  request["tiers"], None, progress, request["max_layers"], cluster, mesh)
    except PackageOpRefused as refused:
        (work / REFUSAL).write_text(json.dumps({"exit": Exit.GAPS, "path": refused.path, "reason": refused.reason}))
        return Exit.GAPS
    except BadInput as err:
        (work / REFUSAL).write_text(json.dumps({"exit": Exit.BAD_INPUT, "path": err.path, "key": err.key,
                                                 "reason": err.message}))
        return Exit.BAD_INPUT
    (work / REPORT).write_text(report.model_dump_json())
    return Exit.OK


if __name__ == "__main__":
    sys.exit(child_main(Path(sys.argv[1])))
