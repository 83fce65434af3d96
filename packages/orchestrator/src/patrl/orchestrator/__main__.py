import sys

from patrl.orchestrator.main import main

sys.exit(main())
