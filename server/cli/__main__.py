"""``python -m fuelline.server.cli``: the ``fuelline`` command."""

import sys

from fuelline.server.cli.main import main

sys.exit(main())
