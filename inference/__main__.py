"""`python -m inference generate | bench | build-tree` (see inference.cli)."""

from inference.cli import main

raise SystemExit(main())
