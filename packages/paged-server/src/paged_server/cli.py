"""`paged-server` command line."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("paged-server: the HTTP server is not built yet (see issue: HTTP API)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
