"""`paged-server bench`: seeded workloads through our engine (paged and
contiguous KV) and through transformers, side by side in one run, plus the
measured capacity table. ``main(argv)`` is the CLI entry point."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark CLI (see ``paged-server bench --help``)."""
    from paged_server.bench.cli import main as _main

    return _main(argv)


__all__ = ["main"]
