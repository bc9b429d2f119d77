"""``coreshell tracking replay [PATH...] [--uri URI]``: send what runs could not deliver.

A run whose tracking store was down when it ended keeps the records in
``RUN_DIR/tracking/undelivered.jsonl``. This command sends every such file under each PATH
(a run directory, ``outputs/``, a file; default: the current directory) in order, to the
store the file names (or ``--uri``), and renames each file sent in full ``replayed.jsonl``.
The next ``coreshell train`` does the same for the earlier runs beside its run directory.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from torchshell.tracking._replay import pending_files, replay_pending

USAGE = "coreshell tracking replay [PATH...] [--uri URI]"


def tracking_command(args: Sequence[str]) -> int:
    """Runs ``coreshell tracking ...``; returns the exit status (1: some records still wait).

    Example:
        >>> import tempfile
        >>> tracking_command(["replay", tempfile.mkdtemp()])
        coreshell: no undelivered tracking records found
        0
    """
    parser = argparse.ArgumentParser(prog="coreshell tracking", usage=USAGE)
    parser.add_argument("action", choices=["replay"])
    parser.add_argument("paths", nargs="*", default=["."])
    parser.add_argument("--uri", default=None, help="send to this store instead")
    ns = parser.parse_args(list(args))
    if not pending_files(*ns.paths):
        print("coreshell: no undelivered tracking records found")
        return 0
    replay_pending(*ns.paths, tracking_uri=ns.uri)
    left = pending_files(*ns.paths)
    if left:
        print(f"coreshell: {len(left)} file(s) still undelivered: {[str(p) for p in left]}")
        return 1
    return 0


__all__ = ["tracking_command"]
