"""`python -m specgui ...`: see `specgui.cli`."""

import sys

from specgui.cli import main

sys.exit(main())
