"""A matrix row's process that stages its export and hangs, as one killed at its timeout_s in the
middle of an export (test_a_row_killed_mid_export_leaves_no_staging_folder): run as the runner runs
``kvexport.matrix.row``, ``python -m tests.matrix.hanging_row ROW_DIR``."""

import sys
import time
from pathlib import Path

from kvexport.artifact.staging import staged_folder

with staged_folder(Path(sys.argv[1]) / "artifact") as folder:
    (folder / "model.pte").write_bytes(b"half a program")
    time.sleep(600)
