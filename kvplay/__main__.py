import sys

from kvplay.app.settings import bound_openmp_spin  # imports no torch

bound_openmp_spin()              # before torch starts its OpenMP threads: see kvplay.app.settings.SPIN_COUNT

if sys.argv[1:2] == ["advise"]:  # asked before: the kept answer, printed before torch loads (kvplay.cli.answers)
    from kvplay.cli.answers import print_kept  # imports no torch

    if print_kept(sys.argv[2:]):
        sys.exit(0)

from kvplay.cli.main import main  # noqa: E402

sys.exit(main())
