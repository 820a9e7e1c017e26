import os
import sys

from kvplay.app.settings import SPIN_COUNT  # imports no torch

os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)   # before torch starts its OpenMP threads: see SPIN_COUNT

from kvplay.cli.main import main  # noqa: E402

sys.exit(main())
