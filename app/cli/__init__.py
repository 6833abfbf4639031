"""The `atropos` command."""

import gc

# Importing the hub allocates hundreds of thousands of objects and frees none: the
# collector's passes meanwhile are ~15% of the time to start (a restarted hub must
# answer within a second).
gc.disable()
from app.cli.main import main  # noqa: E402

gc.enable()

__all__ = ["main"]
