"""``python -m fuelline.server``: the ``fuelline`` command."""

import sys

from fuelline.server.cli.main import main

sys.exit(main())
