# Lets `uv run apps/train` (python runs a directory through its __main__.py) start the app.
from klppo_train.__main__ import main

raise SystemExit(main())
