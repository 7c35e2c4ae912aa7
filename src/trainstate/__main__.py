import sys

from trainstate._cli import main

sys.exit(main())
