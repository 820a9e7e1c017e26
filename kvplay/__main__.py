import sys

from kvplay.cli.main import main

sys.exit(main())
