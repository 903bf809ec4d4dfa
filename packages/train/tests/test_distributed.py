"""Two processes x 4 CPU devices train exactly like one process with 8, save one checkpoint
together, and that checkpoint restores into the group, into a single process on 8 devices and on
one, each verifying the shard digests every process recorded; a damaged shard (flipped bytes, a
truncated file) is refused by both processes of a group, with the same message."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from bd_train.distributed import DistributedError, ProcessGroup, free_port

WORKER = Path(__file__).with_name("distributed_worker.py")
RESTORES = 100  # clean restores in one process (each group process makes the worker's RESTORES)


def _worker_module():
    spec = importlib.util.spec_from_file_location("distributed_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _group(directory: Path, env: dict, *extra: str) -> list[str]:
    """The worker as a two-process group on `directory`; each process's `restore-<id>.txt`."""
    coordinator = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, str(WORKER), coordinator, "2", str(i), str(directory), *extra],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    for proc in procs:
        output = proc.communicate(timeout=300)[0]
        assert proc.returncode == 0, output[-3000:]
    return [(directory / f"restore-{i}.txt").read_text() for i in range(2)]


@pytest.fixture(scope="module")
def group(tmp_path_factory, child_xla_flags):
    """The group's run and the 8-device reference (computed while the group runs)."""
    group_dir, single_dir = tmp_path_factory.mktemp("group"), tmp_path_factory.mktemp("single")
    env = {**os.environ, "XLA_FLAGS": child_xla_flags, "JAX_PLATFORMS": "cpu"}
    coordinator = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, str(WORKER), coordinator, "2", str(i), str(group_dir)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    worker = _worker_module()
    want_losses, want_state = worker.train(single_dir)
    for proc in procs:
        output = proc.communicate(timeout=300)[0]
        assert proc.returncode == 0, output[-3000:]
    return group_dir, env, worker, want_losses, want_state


def test_two_processes_equal_one_and_share_a_checkpoint(group):
    assert jax.device_count() == 8
    group_dir, _, worker, want_losses, want_state = group
    for index in range(2):
        got = json.loads((group_dir / f"losses-{index}.json").read_text())
        np.testing.assert_allclose(got, want_losses, rtol=1e-5)
        assert (group_dir / f"restore-{index}.txt").read_text() == "restored"

    from bd_train import Checkpointer

    one_device = jax.tree.map(lambda x: jax.device_put(x, jax.devices()[0]) if isinstance(x, jax.Array) else x,
                              want_state)
    with Checkpointer(group_dir / "checkpoints", create=False) as checkpoints:
        assert checkpoints.all_steps() == [worker.STEPS]
        digests = checkpoints.read_meta()["digests"]
        restored = checkpoints.restore(want_state)
        alone = checkpoints.restore(one_device)
    # every shard of the fsdp-sharded embedding has its digest, written by the process that held it
    assert len(digests["model/embedding"]) == 2
    for got, want in zip(jax.tree.leaves(restored.params), jax.tree.leaves(want_state.params)):
        assert got.sharding == want.sharding
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.tree.leaves(restored.opt_state), jax.tree.leaves(want_state.opt_state)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.tree.leaves((alone.params, alone.opt_state)),
                         jax.tree.leaves((restored.params, restored.opt_state))):
        assert got.sharding.device_set == {jax.devices()[0]}
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_clean_checkpoint_is_never_refused(group):
    """The group's checkpoint restored again and again, into one process on 8 devices and on one,
    with the digest check threaded as in production (each group process restored it
    `RESTORES` times too): concurrent reads of one shard once refused 1 restore in 400."""
    from bd_train import CheckpointCorrupted, Checkpointer

    group_dir, _, worker, _, want_state = group
    one_device = jax.tree.map(lambda x: jax.device_put(x, jax.devices()[0]) if isinstance(x, jax.Array) else x,
                              want_state)
    refused = []
    with Checkpointer(group_dir / "checkpoints", create=False) as checkpoints:
        for i in range(RESTORES):
            try:
                checkpoints.restore(want_state if i % 2 else one_device)
            except CheckpointCorrupted as err:
                refused.append(str(err))
    assert refused == [], f"{len(refused)} of {RESTORES} clean restores refused: {refused[0]}"
    assert worker.RESTORES >= 50


def _stored_values(item_dir: Path) -> list[tuple[str, Path, int, int]]:
    """`(key, data file, offset, length)` of every chunk an OCDBT item stores out of line, from its
    B-tree (TensorStore's own dump): where each shard's bytes are in the files."""
    import tensorstore as ts
    from tensorstore import ocdbt

    base = ts.KvStore.open(f"file://{item_dir}/").result()
    out, nodes = [], [version["root"]["location"] for version in ocdbt.dump(base).result()["versions"]]
    while nodes:
        for entry in ocdbt.dump(base, nodes.pop()).result()["entries"]:
            if "node" in entry or "location" in entry:
                nodes.append(entry.get("location") or entry["node"])
            elif "indirect_value" in entry:
                prefix, name, offset, length = entry["indirect_value"].removeprefix("value:").rsplit(":", 3)
                key = entry["key"].decode() if isinstance(entry["key"], bytes) else entry["key"]
                out.append((key, item_dir / prefix / name, int(offset), int(length)))
    return out


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_shard_is_refused_by_every_process_of_the_group(group, tmp_path, damage):
    """A model chunk that process 1 wrote, located in its data file: bytes flipped inside it, or the
    file cut in its middle. Both processes refuse the checkpoint with one and the same line that
    names the array and shard, whichever of them read the damaged part."""
    group_dir, env, *_ = group
    shutil.copytree(group_dir / "checkpoints", tmp_path / "checkpoints")
    (step_dir,) = (tmp_path / "checkpoints").glob("[0-9]*")
    values = [v for v in _stored_values(step_dir / "model") if "ocdbt.process_1" in str(v[1])]
    assert values, "process 1 stored no model chunk out of line"
    key, file, offset, length = max(values, key=lambda v: v[3])
    data = bytearray(file.read_bytes())
    if damage == "flip":
        for i in range(offset + length // 3, offset + 2 * length // 3):
            data[i] ^= 0x5A
    else:
        del data[offset + length // 2:]
    file.write_bytes(bytes(data))
    messages = _group(tmp_path, env, "restore")
    assert messages[0] == messages[1], messages
    message = messages[0]
    assert message.startswith(f"checkpoint {tmp_path / 'checkpoints'} step ") and len(message.splitlines()) == 1
    assert "No earlier step is kept: remove " in message and "rerun the stage that wrote it" in message
    assert "slice(" not in message
    array = "model/" + key.split("/")[0].replace(".", "/")
    assert f"the content of {array} (shard " in message, message
    if damage == "truncate":
        assert "could not be read on process " in message, message
    else:  # one chunk changed: that shard alone is named
        assert "differs from what was saved" in message or "could not be read on process " in message, message
        assert message.count("(shard ") == 1, message


def test_process_group_from_the_environment():
    assert ProcessGroup.from_env({}) == ProcessGroup.single()
    env = {"BDLM_COORDINATOR_ADDRESS": "10.0.0.1:1234", "BDLM_NUM_PROCESSES": "4", "BDLM_PROCESS_ID": "3"}
    assert ProcessGroup.from_env(env) == ProcessGroup("10.0.0.1:1234", 4, 3)
    with pytest.raises(DistributedError, match=r"only \['BDLM_NUM_PROCESSES'\] are set"):
        ProcessGroup.from_env({"BDLM_NUM_PROCESSES": "2"})
    with pytest.raises(DistributedError, match="BDLM_PROCESS_ID: expected an integer, got 'one'"):
        ProcessGroup.from_env({**env, "BDLM_PROCESS_ID": "one"})
    # Each refused by its variable before anything starts (an address without a port was a traceback).
    for changed, message in (({"BDLM_COORDINATOR_ADDRESS": "10.0.0.1"}, r"= '10\.0\.0\.1': expected host:port"),
                             ({"BDLM_NUM_PROCESSES": "0"}, r"BDLM_NUM_PROCESSES = 0: expected the number of processes"),
                             ({"BDLM_PROCESS_ID": "4"}, r"BDLM_PROCESS_ID = 4: expected 0\.\.3")):
        with pytest.raises(DistributedError, match=message):
            ProcessGroup.from_env({**env, **changed})


def test_a_service_that_still_holds_the_port_refuses_a_second_one(capfd):
    """gRPC binds with SO_REUSEPORT: a second coordination service on the port of one that still
    runs (a lingering one, after its process 0 died) started too, and a group's processes could
    split between the two and time out. The second now refuses, saying why."""
    from bd_train._coordinator import ServiceHost, port_taken

    address = f"[::]:{free_port()}"
    assert port_taken(address) is None
    first = ServiceHost.start(address, 1, heartbeat_s=10, shutdown_s=10, linger_s=1.0)
    try:
        assert port_taken(address) is not None
        with pytest.raises(DistributedError, match="coordination service did not start"):
            ServiceHost.start(address, 1, heartbeat_s=10, shutdown_s=10, linger_s=1.0)
        err = capfd.readouterr().err
        assert "another process 0 is listening there" in err and "the port of BDLM_COORDINATOR_ADDRESS" in err
    finally:
        first.stop()
    assert port_taken(address) is None


def test_a_bad_lost_after_is_named(monkeypatch):
    from bd_train.distributed import initialize

    monkeypatch.setenv("BDLM_LOST_AFTER_S", "soon")
    with pytest.raises(DistributedError, match="BDLM_LOST_AFTER_S: expected seconds, got 'soon'"):
        initialize(ProcessGroup.single())
    monkeypatch.setenv("BDLM_LOST_AFTER_S", "1")
    with pytest.raises(DistributedError, match=r"BDLM_LOST_AFTER_S = 1: a process must be allowed at least 2 s"):
        initialize(ProcessGroup.single())
    monkeypatch.delenv("BDLM_LOST_AFTER_S")
    with pytest.raises(DistributedError, match=r"lost_after_s = 0.5: a process must be allowed at least 2 s"):
        initialize(ProcessGroup.single(), lost_after_s=0.5)
    monkeypatch.setenv("BDLM_JOIN_TIMEOUT_S", "0")
    with pytest.raises(DistributedError, match=r"BDLM_JOIN_TIMEOUT_S = 0: expected seconds, >= 1"):
        initialize(ProcessGroup.single())
    monkeypatch.delenv("BDLM_JOIN_TIMEOUT_S")
    assert initialize(ProcessGroup.single()) == ProcessGroup.single()


def test_the_group_is_detected_from_bdlm_variables_then_from_the_cluster(monkeypatch):
    """`python -m bd_train.stages run` joins the group `ProcessGroup.detect` finds: the `BDLM_*`
    variables, else JAX's cluster detection (here SLURM's variables, as `srun` sets them for the
    second task of two on one node), else one process."""
    for name in [n for n in os.environ if n.startswith(("SLURM_", "OMPI_", "BDLM_", "KUBERNETES_"))]:
        monkeypatch.delenv(name)
    monkeypatch.delenv("JAX_COORDINATOR_PORT", raising=False)
    assert ProcessGroup.detect()[0] == ProcessGroup.single()
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
             "SLURM_LOCALID": "1", "SLURM_STEP_NUM_NODES": "1", "JAX_COORDINATOR_PORT": "51234"}
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    group, source = ProcessGroup.detect()
    assert group == ProcessGroup("127.0.0.1:51234", 2, 1) and "slurm" in source
    monkeypatch.setenv("BDLM_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("BDLM_NUM_PROCESSES", "4")
    monkeypatch.setenv("BDLM_PROCESS_ID", "3")
    assert ProcessGroup.detect() == (ProcessGroup("10.0.0.1:1234", 4, 3), "the BDLM_* environment")
    monkeypatch.setenv("JAX_LOCAL_DEVICE_IDS", "1")  # JAX's one process per device: not how bdlm runs
    with pytest.raises(DistributedError, match=r"JAX_LOCAL_DEVICE_IDS = '1': bdlm runs one process per host"):
        ProcessGroup.detect()


def test_a_group_whose_processes_see_different_run_folders_is_refused_at_the_start(tmp_path):
    """`[run] output_dir` on each host's own disk: the group used to train until its first save,
    then die with a traceback on one process and a stall on the other. Every process now refuses
    at the start, naming the processes that do not see process 0's folder."""
    import tomllib

    preset = tomllib.loads((Path(__file__).resolve().parents[3] / "flows" / "configs" / "smoke.toml").read_text())
    preset["run"]["output_dir"] = "runs"  # relative: each process's own working folder
    preset["mesh"] = {"data": 2, "num_nodes": 2}
    text = "\n".join(f"[{name}]\n" + "\n".join(f"{k} = {json.dumps(v)}" for k, v in section.items())
                     for name, section in preset.items() if isinstance(section, dict) and
                     all(not isinstance(v, dict) for v in section.values()))
    (tmp_path / "p.toml").write_text(text)
    coordinator = f"127.0.0.1:{free_port()}"
    procs = []
    for index in range(2):
        (tmp_path / f"host{index}").mkdir()
        env = {**os.environ, "BDLM_COORDINATOR_ADDRESS": coordinator, "BDLM_NUM_PROCESSES": "2",
               "BDLM_PROCESS_ID": str(index), "WANDB_MODE": "disabled", "BDLM_PROGRESS": "0"}
        env.pop("XLA_FLAGS", None)
        procs.append(subprocess.Popen([sys.executable, "-m", "bd_train.stages", "run", str(tmp_path / "p.toml"),
                                       "--stage", "sft", "--run-id", "r"], cwd=tmp_path / f"host{index}", env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [proc.communicate(timeout=240) for proc in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 1, err[-2000:]
        assert "run.output_dir: process(es) [1] do not see the folder" in err and "shared storage" in err
        assert "sft-teacher:" not in err  # nothing trained


class _Store:
    """The coordinator's key-value store as the group watch uses it, in memory; `hold_s` holds the
    watch's next heartbeat that long, as a host paused or starved holds every thread of it."""

    def __init__(self):
        self.values: dict[str, str] = {}
        self.hold_s = 0.0
        self.held_until: float | None = None

    def key_value_set(self, key: str, value: str, allow_overwrite: bool) -> None:
        if self.hold_s:
            time.sleep(self.hold_s)
            self.hold_s, self.held_until = 0.0, time.monotonic()
        self.values[key] = value

    def key_value_try_get(self, key: str) -> str:
        if key not in self.values:
            raise RuntimeError(f"NOT_FOUND: {key}")
        return self.values[key]


@pytest.mark.parametrize("held", [False, True])
def test_a_held_host_times_the_others_again_and_still_finds_a_silent_one(monkeypatch, held):
    """Process 1 beat once and then went silent. The watch of process 0 names it lost `lost_after`
    seconds after its last beat was seen; when process 0 was itself held past that (the whole host
    paused, process 1 with it), it times process 1's silence again from its waking, so a host's
    pause is not a lost process, and the silent one is still found."""
    from jax._src import distributed as jax_distributed

    from bd_train import _distributed

    store, lost = _Store(), []
    store.values["bdlm/alive/1"] = "1"
    monkeypatch.setattr(jax_distributed.global_state, "client", store)
    watch = _distributed._Watch(ProcessGroup("127.0.0.1:1", 2, 0), lost_after=2.0)

    def record(group, who, why):
        lost.append((who, time.monotonic()))
        watch.finished.set()  # the watch ends here as `_lost` would end its process

    monkeypatch.setattr(_distributed, "_lost", record)
    store.hold_s = 3.0 if held else 0.0
    started = time.monotonic()
    watch.start()
    watch.join(timeout=30)
    assert [who for who, _ in lost] == ["process 1"]
    silent_from = store.held_until if held else started
    assert silent_from is not None
    assert watch.lost_after <= lost[0][1] - silent_from <= 3 * watch.lost_after  # found, and not sooner
