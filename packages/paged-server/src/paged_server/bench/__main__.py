"""``python -m paged_server.bench`` = ``paged-server bench``."""

from __future__ import annotations

import sys

from paged_server.bench import main

raise SystemExit(main(sys.argv[1:]))
