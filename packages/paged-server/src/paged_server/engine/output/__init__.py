"""From tokens to what a caller gets: stop checks, text deltas, ``RequestOutput``."""
