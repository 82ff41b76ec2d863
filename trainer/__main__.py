"""``torchrun --nproc_per_node N -m fuelline.trainer --servers HOST:PORT …``"""

import sys

from fuelline.trainer.train import main

if __name__ == "__main__":
    sys.exit(main())
