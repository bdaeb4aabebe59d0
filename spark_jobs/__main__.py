"""`python -m spark_jobs` is the `microbatch` command.

`spark-submit` runs a Python file, not a module:
``spark-submit --master spark://host:7077 spark_jobs/__main__.py run pipeline.yaml``
works too. Run as a file, Python puts this folder first on `sys.path`, where
the package's modules (`spec`, `state`, ...) would shadow top-level modules of
the same names; the project root goes there instead.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from spark_jobs.cli import main  # noqa: E402 - after the path fix above

sys.exit(main())
