import sys

from .cli.console import main

sys.exit(main())
