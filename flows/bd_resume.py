"""A fix for Metaflow's `resume` of a run that was itself resumed, applied where the flow is
imported (the process that runs the flow's runtime).

Metaflow copies a `@parallel` control task's `_control_mapper_tasks` verbatim when `resume`
clones it, and gives the clone a new task id: in a resumed run they still name the tasks of the
run that first executed the nodes. A `resume --origin-run-id <that resumed run>` then finds no
control task among its own and reruns every finished `@parallel` step (Metaflow 2.19,
`NativeRuntime.clone_original_run`). The patch maps those pathspecs, through each clone's
`origin-run-id` / `origin-task-id` metadata, onto the tasks of the run being resumed.
"""


def _clone_map(flow: str, run_id: str, depth: int = 8) -> dict[str, str]:
    """`{"<run>/<step>/<task>" of an earlier run: the same task's pathspec in run_id}`, following
    clones of clones back to the run that executed each task."""
    from metaflow import Run

    mapping: dict[str, str] = {}
    origin_runs = set()
    for step in Run(f"{flow}/{run_id}", _namespace_check=False):
        for task in step:
            meta = task.metadata_dict
            if "origin-run-id" in meta and "origin-task-id" in meta:
                origin_runs.add(meta["origin-run-id"])
                mapping[f"{meta['origin-run-id']}/{step.id}/{meta['origin-task-id']}"] = f"{run_id}/{step.id}/{task.id}"
    if depth > 0:
        for origin in origin_runs:  # that run's own clones, mapped on through it
            for older, there in _clone_map(flow, origin, depth - 1).items():
                if there in mapping:
                    mapping.setdefault(older, mapping[there])
    return mapping


class _Mapped:
    """A task datastore of the run being resumed, its `_control_mapper_tasks` mapped onto that run."""

    def __init__(self, ds, mapping: dict[str, str]):
        self._ds, self._mapping = ds, mapping

    def __getattr__(self, name):
        return getattr(self._ds, name)

    def __contains__(self, name):
        return name in self._ds

    def __getitem__(self, name):
        value = self._ds[name]
        if name == "_control_mapper_tasks" and value:
            value = [self._mapping.get(pathspec, pathspec) for pathspec in value]
        return value

    def get(self, name, default=None):
        return self[name] if name in self else default


class _MappedSet:
    def __init__(self, origin, mapping: dict[str, str]):
        self._origin, self._mapping = origin, mapping

    def __iter__(self):
        return (_Mapped(ds, self._mapping) for ds in self._origin)

    def __getattr__(self, name):
        return getattr(self._origin, name)


def rebase_cloned_mapper_tasks() -> None:
    """Patch `NativeRuntime.clone_original_run` (once) so that the finished `@parallel` steps of a
    resumed run are cloned again by the next `resume`."""
    from metaflow.runtime import NativeRuntime

    original = NativeRuntime.clone_original_run
    if getattr(original, "_bdlm_rebased", False):
        return

    def clone_original_run(self, *args, **kwargs):
        origin = self._origin_ds_set
        if origin is None:
            return original(self, *args, **kwargs)
        self._origin_ds_set = _MappedSet(origin, _clone_map(self._flow.name, self._clone_run_id))
        try:
            return original(self, *args, **kwargs)
        finally:
            self._origin_ds_set = origin

    clone_original_run._bdlm_rebased = True  # pyright: ignore[reportFunctionMemberAccess]
    NativeRuntime.clone_original_run = clone_original_run
