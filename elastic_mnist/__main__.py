"""`python -m elastic_mnist SUBCOMMAND ...` is the same as the `elastic-mnist` console script."""

import sys

from elastic_mnist.cli import main

sys.exit(main())
