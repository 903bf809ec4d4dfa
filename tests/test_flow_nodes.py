"""The flow's Metaflow glue (flows/bd_nodes.py): every node of a `@parallel` step finds the same
coordinator, and the fault hook names one stage and step."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "flows"))
import bd_nodes  # noqa: E402

from bd_train.distributed import ProcessGroup  # noqa: E402


def test_process_group_from_metaflow_parallel():
    from metaflow.metaflow_current import Parallel

    nodes = [Parallel(main_ip="10.0.0.7", num_nodes=2, node_index=i, control_task_id="12") for i in range(2)]
    groups = [bd_nodes.process_group(node, run_id="5") for node in nodes]
    assert groups[0].coordinator_address == groups[1].coordinator_address  # every node finds the same port
    assert groups[0].coordinator_address.startswith("10.0.0.7:")
    assert [g.process_id for g in groups] == [0, 1] and groups[0].num_processes == 2
    assert bd_nodes.process_group(nodes[0], port=4321).coordinator_address == "10.0.0.7:4321"
    single = Parallel(main_ip="127.0.0.1", num_nodes=1, node_index=0, control_task_id="3")
    assert bd_nodes.process_group(single) == ProcessGroup.single()


@pytest.mark.parametrize("value, stage, expected", [("grpo:2", "grpo", 2), ("grpo:2", "opd", None),
                                                    ("", "sft-student", None), ("sft-teacher:5", "sft-teacher", 5)])
def test_fail_after_names_one_stage(monkeypatch, value, stage, expected):
    monkeypatch.setenv(bd_nodes.FAULT_ENV, value)
    assert bd_nodes.fail_after(stage) == expected
