"""elasticd.elastic.state: commit/restore in one process, and sync across 3 real gloo ranks
(tests/fixtures/elastic_state_worker.py, run once for the module)."""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hostwide import free_port

from elasticd.elastic import runtime
from elasticd.elastic.errors import HostsUpdatedInterrupt
from elasticd.elastic.state import ObjectState, State, TorchState

WORKER = Path(__file__).resolve().parents[1] / "fixtures" / "elastic_state_worker.py"
WORLD_SIZE = 3
WORKERS_TIMEOUT = 180.0  # a bound for a loaded machine (the workers' own group timeout: 30 s)
# the ranks' run (three torch processes) is one module fixture: on one xdist worker, once
pytestmark = pytest.mark.xdist_group("elastic_state")


@pytest.fixture(autouse=True)
def no_membership_changes(monkeypatch):
    monkeypatch.setattr(runtime, "check_host_updates", lambda: None)


def assert_equal_state(actual, expected, path="state"):
    """Equal all the way down, tensors included (dtype and shape too)."""
    assert type(actual) is type(expected), path
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), path
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), path
        for key in expected:
            assert_equal_state(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), path
        for index, (item, expected_item) in enumerate(zip(actual, expected, strict=True)):
            assert_equal_state(item, expected_item, f"{path}[{index}]")
    else:
        assert actual == expected, path


def make_trained(seed=0, steps=2):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(steps):
        train_step(model, optimizer)
    return model, optimizer


def train_step(model, optimizer):
    optimizer.zero_grad()
    model(torch.randn(8, 3)).pow(2).mean().backward()
    optimizer.step()


def copy_of(model, optimizer):
    return copy.deepcopy((model.state_dict(), optimizer.state_dict()))


# --- State ------------------------------------------------------------------------------


def test_base_state_leaves_save_restore_sync_to_subclasses():
    state = State()
    for method in (state.save, state.restore, state.sync, state.commit):
        with pytest.raises(NotImplementedError):
            method()


def test_reset_callbacks_run_in_registration_order():
    calls = []
    state = ObjectState()
    state.register_reset_callbacks([lambda: calls.append("a"), lambda: calls.append("b")])
    state.register_reset_callbacks([lambda: calls.append("c")])
    state.on_reset()
    state.on_reset()
    assert calls == ["a", "b", "c"] * 2


def test_commit_saves_then_checks_host_updates(monkeypatch):
    """The interrupt propagates, and the step that just ended is the one restore brings back."""
    checks = []

    def interrupt():
        checks.append(state.epoch)
        raise HostsUpdatedInterrupt(skip_sync=True)

    state = ObjectState(epoch=1)
    monkeypatch.setattr(runtime, "check_host_updates", interrupt)
    state.epoch = 2
    with pytest.raises(HostsUpdatedInterrupt) as raised:
        state.commit()
    assert raised.value.skip_sync and checks == [2]
    state.epoch = 5
    state.restore()
    assert state.epoch == 2


# --- ObjectState ------------------------------------------------------------------------


def test_attributes_read_and_assign():
    state = ObjectState(epoch=0, batch=0)
    state.epoch = 3
    assert (state.epoch, state.batch) == (3, 0)


def test_restore_before_any_commit_gives_the_constructor_values():
    state = ObjectState(epoch=0, losses=[])
    state.epoch = 9
    state.losses.append(1.0)  # in place: the saved copy must not see it
    state.restore()
    assert (state.epoch, state.losses) == (0, [])


def test_restore_gives_copies_of_the_committed_values():
    state = ObjectState(history={"losses": [1.0]}, weights=torch.zeros(3))
    state.commit()
    for _ in range(2):
        state.history["losses"].append(2.0)
        state.weights += 1  # in place on the live tensor
        state.restore()
        assert state.history == {"losses": [1.0]}
        assert torch.equal(state.weights, torch.zeros(3))


def test_restore_keeps_requires_grad():
    state = ObjectState(scale=torch.ones(2, requires_grad=True))
    state.restore()
    assert state.scale.requires_grad and state.scale.is_leaf


@pytest.mark.parametrize("name", ["_private", "save", "commit", "sync", "on_reset"])
def test_names_that_would_hide_members_are_refused(name):
    with pytest.raises(ValueError, match=repr(name)):
        ObjectState(**{name: 1})


def test_sync_without_a_process_group_saves():
    state = ObjectState(epoch=0, t=torch.zeros(1))
    state.epoch = 4
    state.sync()
    state.epoch = 7
    state.restore()
    assert state.epoch == 4


def test_sync_refuses_values_that_cannot_travel():
    state = ObjectState(foo=[1, 2, object()])
    with pytest.raises(TypeError, match=r"^state\.foo\[2\]: cannot broadcast a value of type obj"):
        state.sync()


# --- TorchState in one process ----------------------------------------------------------


def test_torch_state_restores_model_and_optimizer():
    model, optimizer = make_trained()
    state = TorchState(model, optimizer, epoch=1)
    assert state.model is model and state.optimizer is optimizer
    state.commit()
    committed = copy_of(model, optimizer)
    for _ in range(2):  # twice: the first restore must not hand the saved tensors to Adam
        train_step(model, optimizer)
        with torch.no_grad():
            model[1].running_mean.add_(1)  # in place: the saved copy must not see it
        state.epoch = 2
        state.restore()
        assert_equal_state(copy_of(model, optimizer), committed)
        assert state.epoch == 1


def test_restore_brings_back_an_empty_optimizer_state():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = TorchState(model, optimizer)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    assert optimizer.state
    state.restore()
    assert not optimizer.state


def test_torch_state_without_model_or_optimizer():
    state = TorchState(epoch=1)
    state.epoch = 2
    state.commit()
    state.sync()
    state.restore()
    assert state.epoch == 2 and state.model is None and state.optimizer is None


def test_restore_leaves_a_model_and_optimizer_given_after_the_last_save():
    state = TorchState(epoch=1)  # saved without a model or an optimizer
    model, optimizer = make_trained()
    state.model, state.optimizer, state.epoch = model, optimizer, 2
    trained = copy_of(model, optimizer)
    state.restore()  # (it handed None to load_state_dict, a TypeError)
    assert_equal_state(copy_of(model, optimizer), trained)
    assert state.epoch == 1
    state.commit()
    train_step(model, optimizer)
    state.restore()
    assert_equal_state(copy_of(model, optimizer), trained)


def test_a_replicated_state_never_imports_dcp():
    """DCP costs a worker 0.3 s of CPU at its start: a script whose model is replicated
    commits, restores and syncs without it (an optimizer imports DTensor: torch's own)."""
    script = (
        "import sys, torch\n"
        "from elasticd import elastic\n"
        "model = torch.nn.Linear(3, 2)\n"
        "state = elastic.TorchState(model=model, optimizer=torch.optim.SGD(model.parameters()))\n"
        "state.commit = state.save  # no agent here: commit's membership check is not wanted\n"
        "state.commit(); state.restore(); state.sync()\n"
        "state.attach(model, state.optimizer)\n"
        "print('torch.distributed.checkpoint' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_single_process_sync_checks_the_optimizer_state_too():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.state[model.weight]["custom"] = {1, 2}
    with pytest.raises(TypeError, match=r"^optimizer\.state\[0\]\.custom: cannot broadcast"):
        TorchState(model, optimizer).sync()


# --- TorchState.sync across real ranks --------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Each rank's results; rank 0 trained, ranks 1 and 2 are newcomers."""
    out_dir = tmp_path_factory.mktemp("elastic_state")
    port = free_port()
    workers = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), str(WORLD_SIZE), str(port), str(out_dir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in range(WORLD_SIZE)
    ]
    deadline = time.monotonic() + WORKERS_TIMEOUT
    outputs = []
    try:
        for worker in workers:
            outputs.append(worker.communicate(timeout=max(0.1, deadline - time.monotonic()))[0])
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    for rank, (worker, output) in enumerate(zip(workers, outputs, strict=True)):
        assert worker.returncode == 0, f"rank {rank} exited {worker.returncode}:\n{output.decode()}"
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD_SIZE)]


def test_newcomers_started_different(ranks):
    root = ranks[0]["before"]
    for newcomer in ranks[1:]:
        before = newcomer["before"]
        assert not torch.equal(before["model"]["0.weight"], root["model"]["0.weight"])
        assert before["optimizer"]["state"] == {} and len(root["optimizer"]["state"]) == 6
        assert before["attrs"]["epoch"] == 0


def test_sync_gives_every_rank_the_root_state(ranks):
    root_before = ranks[0]["before"]
    assert root_before["attrs"]["epoch"] == 3 and root_before["attrs"]["batch"] == 17
    for rank in range(WORLD_SIZE):
        assert_equal_state(ranks[rank]["synced"], root_before, f"rank{rank}")


def test_synced_optimizers_step_alike(ranks):
    """Equal Adam state on every rank (exp_avg, exp_avg_sq, step): one step on the same
    batch leaves equal models."""
    for rank in range(1, WORLD_SIZE):
        assert_equal_state(ranks[rank]["stepped"], ranks[0]["stepped"], f"rank{rank}")
    assert not torch.equal(ranks[0]["stepped"]["0.weight"], ranks[0]["synced"]["model"]["0.weight"])


def test_restore_after_sync_gives_the_synced_state(ranks):
    for rank in range(WORLD_SIZE):
        assert_equal_state(ranks[rank]["restored"], ranks[0]["before"], f"rank{rank}")


def test_broadcast_structure_across_ranks(ranks):
    sent = ranks[0]["structure"]
    assert math.isnan(sent["nan"]) and sent["ints"] == {0: (1, [2, 3]), 1: None}
    for rank in range(1, WORLD_SIZE):
        received = ranks[rank]["structure"]
        assert math.isnan(received.pop("nan"))
        assert_equal_state(
            received, {key: value for key, value in sent.items() if key != "nan"}, f"rank{rank}"
        )


def test_broadcast_into_a_non_contiguous_tensor(ranks):
    for rank in range(WORLD_SIZE):
        assert torch.equal(ranks[rank]["into"], torch.arange(12.0).reshape(3, 4).t()), rank


def test_an_unbroadcastable_root_state_fails_every_rank(ranks):
    assert ranks[0]["sync_error"].startswith("state.bad: cannot broadcast a value of type object")
    for rank in range(1, WORLD_SIZE):
        assert ranks[rank]["sync_error"] == f"rank 0 could not broadcast: {ranks[0]['sync_error']}"
