"""What each tensor-parallel rank of an engine replica reserved in its Ray placement group.

Job: tell the tensor-parallel driver (replica/executor/tensor_parallel.py), running inside a
Serve engine replica, which CPUs and GPUs Ray reserved for each of its ranks, so
that rank i's process uses exactly what bundle i of the replica's placement group
holds (router/serve/app.py asks Serve for one bundle per rank, STRICT_PACK, so every
bundle is on the replica's own node and the driver may start the ranks as local
processes).

* Bundle 0 is the replica actor's own (Serve schedules the replica there): its
  GPU ids are the actor's ``ray.get_gpu_ids()``.
* A GPU bundle i >= 1 gets one tiny probe actor scheduled into it (``num_cpus=0``,
  ``num_gpus`` = the bundle's GPU). It reports the ids Ray gave it and stays alive
  until :meth:`RankResources.release`, so those GPUs stay assigned to this
  replica: no other task of the placement group can be given them meanwhile.
  The probes are owned by the replica actor, so Ray kills them with it if the
  replica dies without releasing.
* CPU-only bundles need no probe: their sizes are read from the placement
  group's bundle specs.

Outside a Ray actor in a placement group (a plain process, ``prefixserve
replica``, the offline ``LLM``, a Ray driver) :func:`reserve_rank_resources`
returns None and the engine keeps its own defaults (``os.cpu_count() // N``
threads per rank, ``cuda:rank``).

Imports Ray only when it is already imported (every Ray worker has imported it),
so calling this in a plain process neither imports nor starts Ray.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

# Starting a probe's worker process on a loaded node can take a while; beyond this the
# replica fails to start (Serve then retries it) instead of hanging.
PROBE_TIMEOUT_S = 120.0


@dataclass
class RankResources:
    """What bundle i of the replica's placement group reserved for rank i.

    ``num_cpus[i]``: bundle i's CPUs (fractional allowed), e.g. for rank i's torch thread count.
    ``cuda_visible_devices[i]``: the GPU id(s) Ray assigned in bundle i, comma-separated when a
    bundle holds more than one, in the form CUDA_VISIBLE_DEVICES takes; None when no bundle
    has a GPU.
    """

    num_cpus: list[float]
    cuda_visible_devices: list[str] | None
    # Probe actors that hold the GPU bundles i >= 1 (see the module docstring).
    probes: list[Any] = field(default_factory=list, repr=False)

    def release(self) -> None:
        """Kill the probe actors (idempotent). Call after the ranks' processes have exited."""
        probes, self.probes = self.probes, []
        if not probes:
            return
        import ray

        for probe in probes:
            try:
                ray.kill(probe, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead, or Ray is shutting down: nothing is held
                pass


def plan_ranks(bundles: list[dict[str, float]], tp_size: int) -> tuple[list[float], list[float]]:
    """Per-rank CPUs and GPUs of ``bundles``, checked against ``tp_size`` (pure).

    Raises ValueError when the number of bundles is not ``tp_size`` or only some
    bundles have a GPU: either means the deployment was not built by
    router/serve/app.py's build_engine for this engine config (e.g. a ``deployments:``
    override in the Serve config changed the bundles).
    """
    if tp_size < 1:
        raise ValueError(f"tp_size must be at least 1, got {tp_size}")
    if len(bundles) != tp_size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} needs one placement-group bundle per rank, but this replica's "
            f"placement group has {len(bundles)}: {bundles}. router/serve/app.py's build_engine sets "
            f"placement_group_bundles from tensor_parallel_size; do not override them in the Serve config"
        )
    cpus = [float(b.get("CPU", 0.0)) for b in bundles]
    gpus = [float(b.get("GPU", 0.0)) for b in bundles]
    if any(gpus) and not all(gpus):
        raise ValueError(f"either every rank's bundle has a GPU or none does, got {bundles}")
    return cpus, gpus


def reserve_rank_resources(tp_size: int, timeout_s: float = PROBE_TIMEOUT_S) -> RankResources | None:
    """What each of ``tp_size`` ranks may use, from the calling Ray actor's placement group.

    Returns None when the caller is not a Ray actor in a placement group (a plain
    process, a Ray driver, a replica deployed without bundles): the engine then
    uses its defaults. Otherwise the caller must sit in bundle 0 (Serve puts the
    replica actor there) and the group must have exactly ``tp_size`` bundles
    (ValueError otherwise, see :func:`plan_ranks`). With GPU bundles this starts
    one probe actor per bundle i >= 1 and waits up to ``timeout_s`` for their GPU
    ids (TimeoutError naming the bundles otherwise); call
    :meth:`RankResources.release` once the ranks are gone.

    The GPU branch is tested against Ray's logical GPUs (``ray.init(num_gpus=...)``
    on a CPU machine: Ray assigns ids without checking hardware), not against
    physical GPUs.
    """
    ray = sys.modules.get("ray")
    # Not imported means not a Ray worker; not initialized means a plain process
    # (get_current_placement_group would start a local Ray).
    if ray is None or not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return None
    from ray.util.placement_group import get_current_placement_group

    pg = get_current_placement_group()
    if pg is None:
        return None
    cpus, gpus = plan_ranks([dict(b) for b in pg.bundle_specs], tp_size)
    if not any(gpus):
        return RankResources(num_cpus=cpus, cuda_visible_devices=None)
    return RankResources(cpus, *_probe_gpus(ray, pg, gpus, timeout_s))


class _GpuProbe:
    """Holds one bundle's GPUs for as long as it lives; reports their ids."""

    def gpu_ids(self) -> list[str]:
        import ray

        return [str(i) for i in ray.get_gpu_ids()]


def _probe_gpus(ray: Any, pg: Any, gpus: list[float], timeout_s: float) -> tuple[list[str], list[Any]]:
    """GPU ids per bundle: bundle 0's from the caller, the others' from probe actors kept alive."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    own = [str(i) for i in ray.get_gpu_ids()]
    probe_class = ray.remote(_GpuProbe)
    probes: dict[int, Any] = {}
    try:
        for index, amount in enumerate(gpus):
            # Bundle 0 is ours; probe it only if the replica actor took none of its GPU.
            if index == 0 and own:
                continue
            probes[index] = probe_class.options(
                num_cpus=0,
                num_gpus=amount,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg,
                    placement_group_bundle_index=index,
                    placement_group_capture_child_tasks=False,
                ),
            ).remote()
        refs = {index: probe.gpu_ids.remote() for index, probe in probes.items()}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        if len(ready) < len(refs):
            late = sorted(i for i, ref in refs.items() if ref not in ready)
            raise TimeoutError(f"GPU probe actors of placement-group bundles {late} did not start within {timeout_s}s")
        ids = {index: ",".join(ray.get(ref)) for index, ref in refs.items()}
    except BaseException:
        RankResources([], None, list(probes.values())).release()
        raise
    devices = [",".join(own) if index not in ids else ids[index] for index in range(len(gpus))]
    return devices, list(probes.values())
