"""`python -m learner.process`: the learner process, as the supervisor starts it (learner.process.shell)."""

import sys

from learner.process.shell import main

sys.exit(main())
