"""An A2PO run SIGKILLed during its value estimate (tests/helpers/a2po_runs.py: the third chunk's rewards kill it):

    python tests/workers/a2po_estimate_worker.py CACHE_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # helpers/

import torch  # noqa: E402

from helpers.a2po_runs import Rewards, fit_a2po  # noqa: E402

if __name__ == "__main__":
    torch.set_num_threads(1)
    fit_a2po(Path(sys.argv[1]), Rewards(kill_at=2))
    raise SystemExit("the run was not killed during its value estimate")
