import sys

from .operations.cli import main

sys.exit(main())
