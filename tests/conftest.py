"""Shared test set-up: the repo root on sys.path, wandb offline, quiet and deterministic torch."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Tests never touch the network; child processes inherit these.
os.environ["WANDB_MODE"] = "offline"
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("PYTHONHASHSEED", "0")
