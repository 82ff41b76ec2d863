"""The user stage a fault schedule's server runs (``--stage support.fault_stage:stage``), steered
by a control file the harness writes (``FAULT_STAGE_CONTROL``, JSON):

* ``{}`` or no file: the batch passes through untouched;
* ``{"mode": "slow", "seconds": s, "splits": [...]}``: each batch of those splits takes ``s``
  seconds (a val batch is one whose sample ids start at ``FAULT_STAGE_VAL_FROM``);
* ``{"mode": "hang"}``: each batch hangs until the mode changes (a server stopped meanwhile
  abandons it); ``<control>.entered`` tells the harness one has.

Batches of two rows or fewer pass through in every mode: the server's start-up probe of the
stage runs on two rows, and must not hang a restart.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

CONTROL = os.environ.get("FAULT_STAGE_CONTROL", "")
VAL_FROM = int(os.environ.get("FAULT_STAGE_VAL_FROM", "0"))


def control() -> dict:
    try:
        with open(CONTROL) as f:
            return json.load(f)
    except (OSError, ValueError):  # none yet, or caught mid-write (the harness replaces it whole)
        return {}


def stage(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    ids = batch["sample_id"]
    if len(ids) <= 2:
        return batch
    now = control()
    if now.get("mode") == "slow" and ("val" if ids[0] >= VAL_FROM else "train") in now["splits"]:
        time.sleep(now["seconds"])
    elif now.get("mode") == "hang":
        open(CONTROL + ".entered", "a").close()
        while control().get("mode") == "hang":
            time.sleep(0.05)
    return batch


def set_control(path: str, **state: object) -> None:
    """Replace the control file at once (a stage never reads half of it)."""
    with open(path + ".tmp", "w") as f:
        json.dump(state, f)
    os.replace(path + ".tmp", path)
