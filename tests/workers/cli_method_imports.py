"""Builds a shipped config's classes with the console script's CLI (``LightalignCLI(run=False)``: parsed and
instantiated, nothing fitted) in a process that imported no lightalign method yet, and prints as JSON the class built
and the lightalign method modules imported. ``argv``: the config, then options added after it."""

from __future__ import annotations

import json
import sys

from lightalign.cli import LightalignCLI
from lightalign.quiet import console_quiet

args, sys.argv = ["--config", *sys.argv[1:]], sys.argv[:1]
with console_quiet():
    cli = LightalignCLI(args=args, run=False)
imported = sorted(name for name in sys.modules if name.startswith("lightalign.modules.")
                  and name.count(".") == 2 and name.rsplit(".", 1)[1] not in ("training",))
print(json.dumps({"model": type(cli.model).__name__, "imported": imported}))
