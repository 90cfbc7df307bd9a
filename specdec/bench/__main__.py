"""``python -m specdec.bench`` is ``specdec bench``."""
import sys

from specdec.bench.run import main

sys.exit(main())
