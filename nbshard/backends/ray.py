"""The "ray" backend: one small Ray actor per node starts nbshard's own launcher there.

Ray places the actors (one per node, ``STRICT_SPREAD``, with the CPUs and GPUs asked for) and
carries everything between the kernel and the nodes as actor calls: the job and its key go
as call arguments, the ranks' signed frames come back in batches that the kernel's side
forwards to its own socket (where they are checked against the run's key as local
ones are), and the ranks' files come home when a node ends. The kernel opens no port. Ray
owns the actors through the kernel's driver: when the kernel dies, Ray kills them, and each
launcher, whose parent the actor is, stops its ranks.

``backend_options``: ``num_cpus`` (per node, default 1), ``num_gpus`` (per node, default 0),
``resources`` (custom Ray resources per node), ``place_timeout`` (seconds to wait for the
cluster to place the nodes, default 60), ``heartbeat`` (seconds a node may not answer before
it counts as lost, default 30), ``env_allow`` (more variable-name prefixes to carry from the
kernel's environment), ``keep`` (keep the actors and their placement for the next job that
asks for the same; ``release_kept()`` frees them, and so does the kernel's exit).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from nbshard.backends.nodes import NodeGroup
from nbshard.backends.ray_agent import CHUNK, NodeAgent
from nbshard.backends.relay import APPENDED, Forwarder, append_home, node_environment
from nbshard.contracts import LaunchSpec, RunOutcome
from nbshard.files import write_atomic
from nbshard.job import check_count, check_seconds
from nbshard.run_dir import RunDir

__all__ = ["release_kept", "start_ray"]

_OPTIONS = {"num_cpus", "num_gpus", "resources", "place_timeout", "heartbeat", "env_allow", "keep"}
PUMP = 0.05  # seconds between a node's batches of frames


def _connection() -> str | None:
    """The Ray this kernel is connected to now, as its driver's job id; None when it is not. An
    actor call after ``ray.shutdown()`` would start a new local Ray (Ray's auto-init), and one
    after a new ``ray.init()`` reaches no actor of the old."""
    import ray

    if not ray.is_initialized():
        return None
    try:
        return str(ray.get_runtime_context().get_job_id())
    except Exception:  # noqa: BLE001 - a Ray mid-shutdown, or a client without the call
        return "unknown" if ray.is_initialized() else None


class RayNode:
    """One node of the run, seen from the kernel: its actor, pumped by a thread of its own."""

    def __init__(self, actor: Any, node_rank: int, forward: Any, heartbeat: float) -> None:
        self.actor, self.node_rank = actor, node_rank
        self.killed = False  # a killed actor is not used again
        self._forward = forward
        self._heartbeat = heartbeat
        self._exit: int | None = None
        self._lost: str | None = None
        self._outcome: RunOutcome | None = None
        self._connection = _connection()  # the Ray its actor lives in
        self._thread = threading.Thread(target=self._pump, name=f"nbshard-ray-node-{node_rank}", daemon=True)
        self._thread.start()

    def _connected(self) -> bool:
        return _connection() == self._connection

    def _pump(self) -> None:
        import ray

        answered = time.monotonic()
        while self._exit is None and self._lost is None:
            if not self._connected():
                self._lost = "this kernel's connection to the Ray its actor runs in ended (ray.shutdown(), or another ray.init())"
                break
            try:
                frames, code = ray.get(self.actor.pump.remote(), timeout=self._heartbeat)
            except ray.exceptions.GetTimeoutError:
                if time.monotonic() - answered > self._heartbeat:
                    self._lost = f"its Ray actor did not answer for {self._heartbeat:g} s (the node froze or its network failed)"
                continue
            except Exception as error:  # noqa: BLE001 - a RayError, or Ray shut down under the call: the node is lost, never the thread
                first_line = next(iter(str(error).splitlines()), "")[:300]
                self._lost = f"its Ray actor died ({type(error).__name__}: {first_line})"
                continue
            answered = time.monotonic()
            for message in frames:
                self._forward(message)
            if code is not None:
                with contextlib.suppress(Exception):
                    outcome = ray.get(self.actor.outcome.remote(), timeout=self._heartbeat)
                    self._outcome = None if outcome is None else RunOutcome.from_json(outcome)
                self._exit = code
            else:
                time.sleep(PUMP)

    def poll(self) -> int | None:
        return self._exit

    def lost(self) -> str | None:
        return self._lost

    def outcome(self) -> RunOutcome | None:
        return self._outcome

    def request(self, command: bytes) -> None:
        if self._connected():  # else its actor is gone with the Ray it ran in
            self.actor.request.remote(command)

    def kill(self) -> None:
        import ray

        self.killed = True
        if self._connected():
            self.actor.kill.remote()
            ray.kill(self.actor)

    def live_log(self, rank: int) -> bytes:
        import ray

        return ray.get(self.actor.log.remote(rank), timeout=self._heartbeat) if self._connected() else b""

    def bring_home(self, run_dir: RunDir) -> None:
        import ray

        if not self._connected():
            return
        for name, size in ray.get(self.actor.rank_files.remote(), timeout=self._heartbeat).items():
            pieces = b"".join(ray.get(self.actor.read.remote(name, offset)) for offset in range(0, max(size, 1), CHUNK))
            if name.startswith(APPENDED):
                append_home(run_dir, name, pieces)
            else:
                write_atomic(run_dir.path / name, pieces)

    def close(self) -> None:
        """Remove this run's directory on the node; the actor itself is the backend's to keep or free."""
        import ray

        if self._lost is None and not self.killed and self._connected():
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(self.actor.clean.remote(True), timeout=10)


def _options(given: Mapping[str, Any]) -> dict[str, Any]:
    unknown = set(given) - _OPTIONS
    if unknown:
        raise ValueError(f"backend_options for ray: unknown {', '.join(sorted(unknown))}; known: {', '.join(sorted(_OPTIONS))}")
    options = {"num_cpus": 1, "num_gpus": 0, "resources": {}, "place_timeout": 60.0, "heartbeat": 30.0, "env_allow": (), "keep": False, **given}
    for name in ("place_timeout", "heartbeat"):
        check_seconds(f"backend_options[{name!r}]", options[name])
    for name in ("num_cpus", "num_gpus"):
        check_count(f"backend_options[{name!r}]", options[name])
    return options


def start_ray(run_dir: RunDir, env: Mapping[str, str], cwd: str, *, preload: Sequence[str] | None = None) -> NodeGroup:
    """One actor per node, placed by Ray; each starts the node's launcher; a ``NodeGroup``
    supervises them. ``env`` is the kernel's launch environment (only part of it travels)."""
    try:
        import ray
    except ImportError:
        raise ImportError("backend='ray' needs Ray: pip install 'nbshard[ray]' (or pip install ray)") from None
    spec = LaunchSpec.read(run_dir.launch)
    options = _options(spec.backend_options)
    if spec.gpus is not None:
        raise ValueError("backend='ray' gives each node the GPUs Ray assigns it: ask with backend_options={'num_gpus': N}, not gpus=")
    if not ray.is_initialized():
        ray.init(log_to_driver=False)  # RAY_ADDRESS, if set, names the cluster; else a local one starts
    connection = _connection()
    nnodes = spec.nnodes
    bundle = {"CPU": options["num_cpus"], **({"GPU": options["num_gpus"]} if options["num_gpus"] else {}), **options["resources"]}
    pool_key = (connection, repr((nnodes, sorted(bundle.items()))))
    key = run_dir.key.read_bytes()
    job = run_dir.job.read_bytes() if run_dir.job.exists() else None
    node_env = node_environment(env, spec.env, options["env_allow"])
    forward = Forwarder(spec.address)
    current: dict[str, Any] = {"nodes": [], "placed": None}  # the attempt's nodes, and its placement and actors

    def usable(nodes: list[RayNode]) -> bool:
        return all(node.lost() is None and not node.killed for node in nodes)

    def launch(restart_count: int) -> list[RayNode]:
        if current["placed"] is None or not usable(current["nodes"]):  # else a restart reuses the actors
            if current["placed"] is not None:
                _free(ray, *current["placed"])
            kept = _KEPT.pop(pool_key, None) if options["keep"] else None
            current["placed"] = kept if kept is not None else _place(ray, nnodes, bundle, options)
        group, actors = current["placed"]
        try:
            master_addr, port = ray.get(actors[0].where.remote(), timeout=options["place_timeout"])
            node_spec = spec.replace(master_addr=master_addr, master_port=spec.master_port or port, restart_count=restart_count)
            ray.get([
                actor.start.remote(
                    node_spec.replace(node_rank=i).to_json(), key, job, node_env,
                    list(preload) if preload is not None and options["keep"] else None,  # warm pays off in kept actors
                )
                for i, actor in enumerate(actors)
            ], timeout=options["place_timeout"])
        except BaseException:
            _free(ray, group, actors)
            current["placed"] = None
            raise
        current["nodes"] = [RayNode(actor, i, forward.send, options["heartbeat"]) for i, actor in enumerate(actors)]
        return current["nodes"]

    try:
        nodes = launch(0)
    except BaseException:
        forward.close()
        raise

    def cleanup() -> None:
        """Keep the actors when asked and all are healthy, else free them and their placement."""
        forward.close()
        if current["placed"] is None or _connection() != connection:  # its actors went with the Ray they ran in
            return
        if options["keep"] and usable(current["nodes"]) and pool_key not in _KEPT:
            _KEPT[pool_key] = current["placed"]
        else:
            _free(ray, *current["placed"])

    return NodeGroup(run_dir, nodes, spec.nproc_per_node, spec.address, cleanup, relaunch=launch, max_restarts=spec.max_restarts)


# Placement and actors kept for the next job asking the same, by the Ray they live in.
_KEPT: dict[tuple[str | None, str], tuple[Any, list[Any]]] = {}


def _place(ray: Any, nnodes: int, bundle: dict[str, Any], options: dict[str, Any]) -> tuple[Any, list[Any]]:
    """A placement group of one bundle per node, each on its own machine, and an actor in each."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group([bundle] * nnodes, strategy="STRICT_SPREAD" if nnodes > 1 else "PACK")
    try:
        ray.get(group.ready(), timeout=options["place_timeout"])
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        alive = [n for n in ray.nodes() if n.get("Alive")]
        raise RuntimeError(
            f"Ray could not place {nnodes} node(s) with {bundle} each on distinct machines within "
            f"{options['place_timeout']:g} s: the cluster has {len(alive)} alive node(s). Add nodes, ask for fewer "
            "resources in backend_options, or lower nnodes."
            + (f" Actors kept with keep=True hold {len(_KEPT)} placement(s): release_kept() frees them." if _KEPT else "")
        ) from None
    agent = ray.remote(NodeAgent)
    return group, [
        agent.options(
            num_cpus=options["num_cpus"], num_gpus=options["num_gpus"], resources=options["resources"] or None,
            max_concurrency=4,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=i),
        ).remote()
        for i in range(nnodes)
    ]


def _free(ray: Any, group: Any, actors: Sequence[Any]) -> None:
    """Remove the actors' directories (where they still answer), kill them, free their placement."""
    from ray.util.placement_group import remove_placement_group

    with contextlib.suppress(Exception):
        ray.get([actor.clean.remote(False) for actor in actors], timeout=5)
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor)
    with contextlib.suppress(Exception):
        remove_placement_group(group)


def release_kept() -> None:
    """Free the actors and placements that ``keep=True`` kept between jobs."""
    import ray

    connection = _connection()
    while _KEPT:
        (kept_in, _), placed = _KEPT.popitem()
        if kept_in == connection:  # those of another Ray went with it
            _free(ray, *placed)
