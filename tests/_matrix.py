"""Which matrix this run covers. The exhaustive one (every option combination, more steps,
tests marked ``exhaustive``) runs with ``FSDP_INT8_FULL_MATRIX=1``; the default run, CI's,
covers a representative subset (README, "Tests")."""

import os

FULL_MATRIX = os.environ.get("FSDP_INT8_FULL_MATRIX") == "1"
