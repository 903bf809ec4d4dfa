"""`python -m bd_train.stages run|summary <preset.toml>`: see `bd_train.stages.cli`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
