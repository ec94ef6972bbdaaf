"""`python -m tierlm.cli`."""

import sys

from tierlm.cli import main

sys.exit(main())
