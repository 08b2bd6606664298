"""``python -m paged_server.default_model [CACHE_DIR]``: create the default
model ahead of time (e.g. in a container build) and print its directory."""

from __future__ import annotations

import sys

from paged_server.default_model import ensure_default_model

if __name__ == "__main__":
    print(ensure_default_model(sys.argv[1] if len(sys.argv) > 1 else None))
