import sys

from transport.cli import main

sys.exit(main())
