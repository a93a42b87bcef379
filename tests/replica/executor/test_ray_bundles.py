"""reserve_rank_resources against a real local Ray: actors in placement groups, CPU and logical-GPU bundles.

Ray assigns logical GPUs declared with ``ray.init(num_gpus=...)`` without checking
hardware, so the GPU branch (probe actors per bundle) runs here on CPU; what it
cannot show is that the ids are right on a machine with physical GPUs.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from prefixserve.replica.executor.ray_bundles import plan_ranks, reserve_rank_resources

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def rank0_class() -> type:
    """A stand-in for the Serve replica actor: calls the helper from bundle 0.

    Defined in a function so Ray pickles it by value (workers cannot import this test module).
    """

    class Rank0:
        def reserve(self, tp_size: int) -> tuple[list[float], list[str] | None, list[str]]:
            import ray

            self.held = reserve_rank_resources(tp_size)
            if self.held is None:
                return [], None, []
            return self.held.num_cpus, self.held.cuda_visible_devices, [str(i) for i in ray.get_gpu_ids()]

        def is_none(self, tp_size: int) -> bool:
            return reserve_rank_resources(tp_size) is None

        def probe_ids(self) -> list[list[str]]:
            """The GPU ids each probe actor holds (it answers: it is alive and holding them)."""
            import ray

            return [ray.get(probe.gpu_ids.remote(), timeout=60) for probe in self.held.probes]

        def release(self) -> None:
            self.held.release()

    return Rank0


@contextlib.contextmanager
def in_bundle0(ray, bundles: list[dict[str, float]], **options) -> Iterator[tuple[Any, Any]]:
    """A placement group of ``bundles`` and a rank-0 actor in its bundle 0: ``(pg, actor)``,
    both gone after the block."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = placement_group(bundles, strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=60)
    actor = (
        ray.remote(rank0_class())
        .options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True
            ),
            **options,
        )
        .remote()
    )
    try:
        yield pg, actor
    finally:
        ray.kill(actor)
        remove_placement_group(pg)


def wait_bundle_gpu_free(ray, pg, index: int, free: float, timeout_s: float = 60.0) -> None:
    """Wait until Ray's view of bundle ``index``'s unassigned GPU is ``free`` (the GCS view lags the raylets)."""
    key = f"GPU_group_{index}_{pg.id.hex()}"
    deadline = time.monotonic() + timeout_s
    while (seen := ray.available_resources().get(key, 0.0)) != free:
        if time.monotonic() > deadline:
            raise AssertionError(f"{key}: {seen} GPU unassigned, expected {free}")
        time.sleep(0.2)


def gpu_task_in_bundle(ray, pg, index: int) -> list[str]:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0, num_gpus=1)
    def ids() -> list[str]:
        return [str(i) for i in ray.get_gpu_ids()]

    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)
    return ray.get(ids.options(scheduling_strategy=strategy).remote(), timeout=120)


def test_a_plain_process_gets_none_without_importing_or_starting_ray():
    code = (
        "import sys; from prefixserve.replica.executor.ray_bundles import reserve_rank_resources as r; "
        "assert r(2) is None; assert 'ray' not in sys.modules, 'imported ray'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_plan_ranks_refuses_a_mismatched_or_mixed_group():
    assert plan_ranks([{"CPU": 2.0, "GPU": 1.0}, {"CPU": 2.0, "GPU": 1.0}], 2) == ([2.0, 2.0], [1.0, 1.0])
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=3 needs one placement-group bundle per rank, "
        r"but this replica's placement group has 2",
    ):
        plan_ranks([{"CPU": 1.0}, {"CPU": 1.0}], 3)
    with pytest.raises(ValueError, match="every rank's bundle has a GPU or none"):
        plan_ranks([{"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0}], 2)


def test_the_driver_and_an_actor_without_a_placement_group_get_none(ray_local):
    assert ray_local.is_initialized()
    assert reserve_rank_resources(2) is None
    actor = ray_local.remote(rank0_class()).options(num_cpus=0).remote()
    try:
        assert ray_local.get(actor.is_none.remote(2), timeout=120)
    finally:
        ray_local.kill(actor)


def test_cpu_bundles_give_each_rank_its_bundles_cpus(ray_local):
    with in_bundle0(ray_local, [{"CPU": 1.5}, {"CPU": 0.5}], num_cpus=1.5) as (pg, actor):
        cpus, devices, _ = ray_local.get(actor.reserve.remote(2), timeout=120)
        assert cpus == [1.5, 0.5] and devices is None
        with pytest.raises(ValueError, match=r"tensor_parallel_size=3 needs one placement-group bundle"):
            ray_local.get(actor.is_none.remote(3), timeout=120)


def test_gpu_bundles_give_each_rank_its_own_gpu_and_hold_it_until_release(ray_local):
    with in_bundle0(ray_local, [{"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": 1}], num_cpus=1, num_gpus=1) as (pg, actor):
        cpus, devices, own = ray_local.get(actor.reserve.remote(2), timeout=120)
        assert cpus == [1.0, 1.0]
        # Rank 0 has the replica actor's GPU; rank 1 the other one of the two in the cluster.
        assert devices is not None and devices[0] == own[0] and sorted(devices) == ["0", "1"]
        # Held: one probe, alive, keeps bundle 1's GPU assigned while the ranks run.
        assert ray_local.get(actor.probe_ids.remote(), timeout=120) == [[devices[1]]]
        wait_bundle_gpu_free(ray_local, pg, 1, 0.0)
        ray_local.get(actor.release.remote(), timeout=60)
        wait_bundle_gpu_free(ray_local, pg, 1, 1.0)
        # Released: bundle 1's GPU can be given to someone else, and it is the id rank 1 was told.
        assert gpu_task_in_bundle(ray_local, pg, 1) == [devices[1]]


def test_probes_die_with_the_replica_actor_that_owns_them(ray_local):
    with in_bundle0(ray_local, [{"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": 1}], num_cpus=1, num_gpus=1) as (pg, actor):
        _, devices, _ = ray_local.get(actor.reserve.remote(2), timeout=120)
        assert devices is not None
        assert ray_local.get(actor.probe_ids.remote(), timeout=120) == [[devices[1]]]
        # The replica dies without release(): its probe goes with it and bundle 1's GPU is free again.
        ray_local.kill(actor)
        wait_bundle_gpu_free(ray_local, pg, 1, 1.0)
        assert gpu_task_in_bundle(ray_local, pg, 1) == [devices[1]]
