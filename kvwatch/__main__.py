import sys

from kvwatch.cli import main

sys.exit(main())
