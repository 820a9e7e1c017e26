import sys

from kvplay.app.settings import bound_openmp_spin  # imports no torch

bound_openmp_spin()              # before torch starts its OpenMP threads: see kvplay.app.settings.SPIN_COUNT

from kvplay.cli.main import main  # noqa: E402

sys.exit(main())
