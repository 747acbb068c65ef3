"""kev-serve's restarts by cause and its readiness: written beside the start's heartbeats, where a stub reads them."""

from __future__ import annotations

from pathlib import Path

from kev_backend.serve.stub.metrics import RESTART_CAUSES, read_supervisor_state, supervisor_state_path
from kev_backend.serve.supervisor import supervisor
from kev_backend.serve.supervisor.children import remove_shm
from kev_backend.serve.supervisor.progress import heartbeat_prefix, pulses_on_disk
from kev_backend.settings import ServeSettings


def test_the_state_lives_with_the_start_and_is_no_heartbeat(tmp_path: Path) -> None:
    prefix = heartbeat_prefix("kev_serve_1_2_3_")
    path = supervisor_state_path(prefix)
    assert path == Path("/dev/shm/kev_serve_1_2_3_supervisor.json")
    assert path.name.startswith("kev_serve_1_2_3_") and not path.name.startswith(Path(prefix).name)


def test_restarts_are_counted_by_cause_and_ready_follows(tmp_path: Path) -> None:
    sup = supervisor.Supervisor(ServeSettings(), {}, "key")
    restarts: list[str] = []
    sup.restart_triton = restarts.append  # type: ignore[method-assign]
    prefix = f"{tmp_path}/kev_serve_9_9_1_heartbeat_"
    sup.state.start(prefix)
    path = supervisor_state_path(prefix)
    assert read_supervisor_state(path) == {
        "ready": False,
        "restarts": {process: dict.fromkeys(causes, 0) for process, causes in RESTART_CAUSES.items()},
    }
    sup.restart("hung", "first start: given up, not counted")  # never ready yet: the first start gives up
    sup.ever_ready = True
    sup.restart("hung", "no progress")
    sup.restart("hung", "no progress")
    sup.restart("stub_died", "stub died")
    sup.state.restarted("gateway", "exited")
    state = read_supervisor_state(path)
    assert state is not None and restarts == [
        "first start: given up, not counted",
        "no progress",
        "no progress",
        "stub died",
    ]
    assert state["restarts"]["triton"] == {**dict.fromkeys(RESTART_CAUSES["triton"], 0), "hung": 2, "stub_died": 1}
    assert state["restarts"]["gateway"] == {"exited": 1}
    sup.triton, sup.ready = object(), True  # type: ignore[assignment]
    sup.supervise = lambda now: None  # type: ignore[method-assign]
    sup.step(0.0)
    assert read_supervisor_state(path)["ready"] is True  # type: ignore[index]
    sup.failures = 1  # a failed probe: not ready for Prometheus while it lasts
    sup.step(0.0)
    assert read_supervisor_state(path)["ready"] is False  # type: ignore[index]
    sup.state.start(f"{tmp_path}/kev_serve_9_9_2_heartbeat_")  # the next start carries the totals on
    assert read_supervisor_state(supervisor_state_path(f"{tmp_path}/kev_serve_9_9_2_heartbeat_")) == state | {
        "ready": False
    }
    assert pulses_on_disk(prefix) == {}  # no heartbeat reader takes the state for an instance


def test_the_state_goes_with_the_start_regions_and_is_not_written_back() -> None:
    sup = supervisor.Supervisor(ServeSettings(), {}, "key")
    region = "kev_serve_test_metrics_0_"
    sup.state.start(heartbeat_prefix(region))
    assert supervisor_state_path(heartbeat_prefix(region)).exists()
    assert remove_shm(region) == ["kev_serve_test_metrics_0_supervisor.json"]
    sup.state.stop()  # the start stopped: a restart counted or readiness changed meanwhile writes nothing
    sup.state.restarted("gateway", "exited")
    sup.state.set_ready(True)
    assert not supervisor_state_path(heartbeat_prefix(region)).exists()
