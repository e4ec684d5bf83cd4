import sys

from lightrft.cli import main

sys.exit(main())
