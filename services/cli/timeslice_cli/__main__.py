import sys

from ._app import main

sys.exit(main())
