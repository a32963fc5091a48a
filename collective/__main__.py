import sys

from collective.cli import main

sys.exit(main())
