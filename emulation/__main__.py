import sys

from .cupy import main

sys.exit(main())
