"""`python -m spark_jobs` is the `microbatch` command."""

from __future__ import annotations

import sys

from spark_jobs.cli import main

sys.exit(main())
