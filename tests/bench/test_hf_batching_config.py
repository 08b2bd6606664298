"""``run_hf_continuous`` builds transformers' ``ContinuousBatchingConfig``
under whichever names the installed release uses (a GPU image with
transformers 5.17 refused ``page_size``)."""

from __future__ import annotations

import dataclasses

from paged_server.bench.hf_baseline import _batching_config


@dataclasses.dataclass
class Release517:  # the fields transformers 5.17 has: block_size, no seed
    block_size: int = 256
    num_blocks: int | None = None
    allow_block_sharing: bool = True


@dataclasses.dataclass
class ReleaseLater:  # page_size, with block_size kept beside it
    page_size: int = 256
    num_blocks: int | None = None
    allow_block_sharing: bool = True
    seed: int | None = None
    block_size: int | None = None


def test_the_block_size_goes_by_the_name_the_release_has() -> None:
    old = _batching_config(Release517, 16, num_blocks=8, allow_block_sharing=False, seed=0)
    assert old == Release517(block_size=16, num_blocks=8, allow_block_sharing=False)
    new = _batching_config(ReleaseLater, 16, num_blocks=8, allow_block_sharing=False, seed=0)
    assert new == ReleaseLater(page_size=16, num_blocks=8, allow_block_sharing=False, seed=0)


def test_the_installed_transformers_takes_the_page_size() -> None:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cfg = _batching_config(ContinuousBatchingConfig, 16, num_blocks=8, seed=0)
    size = getattr(cfg, "page_size", None) or cfg.block_size
    assert (size, cfg.num_blocks) == (16, 8)
