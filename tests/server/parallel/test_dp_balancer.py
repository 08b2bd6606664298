"""The data-parallel balancer on its own (no processes) and what data
parallelism refuses: which replica a request goes to, and why."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from paged_server.config import EngineConfig
from paged_server.data_parallel.balancer import Balancer, ReplicaLoad, block_hashes
from paged_server.data_parallel.engine import merge_metrics, replica_devices
from paged_server.engine.core.llm_engine import LLMEngine
from paged_server.entrypoints.cli import main


def _balancer(n: int = 2, slack: int = 2) -> Balancer:
    return Balancer([ReplicaLoad() for _ in range(n)], block_size=4, slack=slack)


def _send(balancer: Balancer, tokens: list[int]) -> int:
    index, by_prefix = balancer.choose(tokens)
    balancer.record(tokens, index, by_prefix)
    return index


def test_idle_replicas_take_turns_and_the_least_loaded_wins() -> None:
    b = _balancer(3)
    assert [_send(b, [i] * 3) for i in range(3)] == [0, 1, 2]  # short prompts: no prefix blocks
    b.loads[0].waiting, b.loads[1].running, b.loads[2].running = 1, 3, 5
    assert b.choose([9])[0] == 1  # 4 * 1 waiting > 3 running


def test_a_shared_prefix_goes_where_its_blocks_are_until_that_replica_is_too_busy() -> None:
    b = _balancer(slack=2)
    prefix = list(range(100, 116))  # 4 full blocks
    first = _send(b, [*prefix, 1])
    assert b.choose([*prefix, 2]) == (first, True)
    b.loads[first].running = 2  # within the slack of the idle replica
    assert b.choose([*prefix, 3]) == (first, True)
    b.loads[first].running = 3  # beyond it: recomputing the prefix elsewhere is cheaper
    assert b.choose([*prefix, 4]) == (1 - first, False)
    b.loads[first].alive = False  # a dead replica's prefixes are forgotten
    b.loads[first].running = 0
    assert b.choose([*prefix, 5])[0] == 1 - first


def test_block_hashes_chain_so_a_different_first_block_matches_nothing() -> None:
    a, c = block_hashes(list(range(12)), 4), block_hashes([99, *range(1, 12)], 4)
    assert len(a) == 3 and not set(a) & set(c)
    assert block_hashes(list(range(12)), 4)[:2] == block_hashes(list(range(9)), 4)[:2]


def test_no_live_replica_is_an_error() -> None:
    b = _balancer()
    for load in b.loads:
        load.alive = False
    with pytest.raises(RuntimeError, match="no data-parallel replica is alive"):
        b.choose([1, 2, 3])


def test_metrics_sum_counters_of_all_and_gauges_of_the_live() -> None:
    a = {"prefix_cache_hits_total": 10.0, "num_requests_running": 2.0, "kv_cache_usage_perc": 0.5,
         "kv_capacity_blocks": 100.0}  # fmt: skip
    dead = {"prefix_cache_hits_total": 4.0}
    m = merge_metrics([a, dead], [True, False], [3, 1], by_prefix=2)
    assert m["prefix_cache_hits_total"] == 14 and m["num_requests_running"] == 2
    assert m["kv_cache_usage_perc"] == 0.5 and m["dp_replicas_alive"] == 1
    assert m["dp_replica_1_prefix_cache_hits_total"] == 4 and m["dp_replica_1_alive"] == 0
    assert m["dp_replica_0_requests_routed_total"] == 3 and m["dp_requests_routed_by_prefix_total"] == 2


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"nnodes": 2, "tensor_parallel_size": 2}, "data_parallel_size > 1 runs its replicas on this node"),
        ({"data_parallel_size": 0}, "data_parallel_size"),
    ],
)
def test_combinations_not_supported_are_refused(fields: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{"data_parallel_size": 2, **fields}).validate()


def test_serve_refuses_dp_across_nodes_before_starting_anything(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "-dp", "2", "-tp", "2", "--nnodes", "2", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "data_parallel_size > 1 runs its replicas on this node" in err
    assert "behind an HTTP load balancer" in err


def test_replicas_get_consecutive_devices_for_their_ranks() -> None:
    assert replica_devices("cpu", 3, 2) == ["cpu", "cpu", "cpu"]


def test_an_engine_is_one_replica() -> None:
    with pytest.raises(ValueError, match="an LLMEngine is one replica"):
        LLMEngine(EngineConfig(data_parallel_size=2))


def test_a_bad_model_fails_before_any_replica_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "-dp", "2", "--model", str(tmp_path / "missing"), "--port", "0"]) == 2
    assert f"model directory {tmp_path / 'missing'} does not exist" in capsys.readouterr().err
    assert not multiprocessing.active_children()
