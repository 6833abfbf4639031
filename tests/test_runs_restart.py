"""Runs outlive the hub: a restarted hub re-attaches to the runs whose processes are
alive and fails those whose processes are gone, saying why. (Hub processes: they are
stopped, killed -9 and restarted.)"""

from __future__ import annotations

import os
import signal

import pytest

from tests.support.runs import RunsEnv, alive, spec, start, wait_status
from tests.support.waiting import wait_until

pytestmark = pytest.mark.process


def test_a_restarted_hub_reattaches_live_runs_and_fails_dead_ones(runs_env: RunsEnv) -> None:
    finish_live, finish_coded = runs_env.tmp / "finish-live", runs_env.tmp / "finish-coded"
    hub = runs_env.hub_process()
    with hub.client() as client:
        live = start(client, spec(runs_env.child("live-t", "--exit-when", finish_live),
                                  runs_env.child("live-e")))
        dead = start(client, spec(runs_env.child("dead-t"), runs_env.child("dead-e")))
        coded = start(client, spec(runs_env.child("coded-t", "--exit-when", finish_coded,
                                                  "--code", 3)))
        runs = {run_id: wait_status(client, run_id, "running") for run_id in (live, dead, coded)}
        starting = start(client, spec(runs_env.child("starting-t"),
                                      trainer_health={"log": "never printed"}))
        wait_status(client, starting, "starting")
        starting_pid = wait_until(
            lambda: client.get(f"/v1/runs/{starting}").json()["processes"][0]["pid"], 20,
            what="the starting trainer's pid")
    pids = {run_id: [p["pid"] for p in run["processes"]] for run_id, run in runs.items()}

    assert hub.stop(signal.SIGTERM) == 0
    assert all(alive(pid) for run_pids in pids.values() for pid in run_pids)
    assert alive(starting_pid)
    # While no hub watches: one run is killed outright (nothing records an exit code),
    # another's trainer exits 3 on its own.
    for pid in pids[dead]:
        os.killpg(pid, signal.SIGKILL)
    finish_coded.touch()
    _wait_gone(*pids[dead], pids[coded][0])

    hub.start()
    with hub.client() as client:
        run = wait_status(client, live, "running")
        assert [p["pid"] for p in run["processes"]] == pids[live]
        assert f"run {live}: re-attached (trainer pid {pids[live][0]}, env_0 pid" in hub.log

        run = wait_status(client, dead, "failed")
        trainer = run["processes"][0]
        assert run["error_message"] == (
            f"Trainer (pid {trainer['pid']}) is gone and nothing recorded its exit code "
            f"(killed with SIGKILL, or the machine restarted). Check {trainer['log_path']}"
        )

        run = wait_status(client, coded, "failed")
        trainer = run["processes"][0]
        assert trainer["exit_code"] == 3
        assert run["error_message"] == f"Trainer exited with code 3. Check {trainer['log_path']}"

        run = wait_status(client, starting, "failed")
        assert run["error_message"].startswith("The hub stopped while the run was starting")
        assert not alive(starting_pid)

    # kill -9 this time: the run still names the dead hub as its watcher.
    hub.kill()
    hub.start()
    with hub.client() as client:
        assert wait_status(client, live, "running")["processes"][0]["pid"] == pids[live][0]
        finish_live.touch()
        run = wait_status(client, live, "completed")
    # Its exit code came from the launcher's file: this hub is not the trainer's parent.
    assert [p["exit_code"] for p in run["processes"]] == [0, -15]
    assert not any(alive(pid) for pid in pids[live])


def test_a_stop_taken_by_another_hub_is_carried_out(runs_env: RunsEnv) -> None:
    """Two hubs share the database. A DELETE that the other hub answers is carried out
    by the watching hub at its next poll, or by the other hub itself once the watcher
    is dead."""
    watcher, other = runs_env.hub_process(), runs_env.hub_process()
    with watcher.client() as w, other.client() as o:
        first = start(w, spec(runs_env.child("t1"), runs_env.child("e1")))
        pids = [p["pid"] for p in wait_status(w, first, "running")["processes"]]
        assert o.delete(f"/v1/runs/{first}").json()["status"] == "stopping"
        assert wait_status(o, first, "stopped")["processes"][0]["exit_code"] == -15
        assert not any(alive(pid) for pid in pids)
        watcher.wait_for_log(f"run {first}: stopped")  # logged as the move commits

        second = start(w, spec(runs_env.child("t2"), runs_env.child("e2")))
        pids = [p["pid"] for p in wait_status(w, second, "running")["processes"]]
        watcher.kill()
        assert o.delete(f"/v1/runs/{second}").json()["status"] == "stopping"
        run = wait_status(o, second, "stopped")
    assert [p["exit_code"] for p in run["processes"]] == [-15, -15]
    assert not any(alive(pid) for pid in pids)
    other.wait_for_log(f"run {second}: stopped")


def test_a_stop_cut_short_by_a_hub_crash_is_finished_by_the_next_hub(
    runs_env: RunsEnv,
) -> None:
    hub = runs_env.hub_process()
    with hub.client() as client:
        body = spec(
            runs_env.child("t"),
            runs_env.child("e", "--ignore-sigterm"),
            # Up means its SIGTERM handler is in place.
            trainer_health={"log": "t started"},
            env_health=[{"log": "e started"}],
            stop_timeout=2,
        )
        run_id = start(client, body)
        pids = [p["pid"] for p in wait_status(client, run_id, "running")["processes"]]
        client.delete(f"/v1/runs/{run_id}")
        wait_until(lambda: any(e["event"] == "sigterm" for e in runs_env.events()), 10,
                   what="a SIGTERM", poll=0.02)
    hub.kill()  # while it waits for the environment that shrugs SIGTERM off
    assert all(alive(pid) for pid in pids)
    hub.start()
    with hub.client() as client:
        run = wait_status(client, run_id, "stopped")
    assert [p["exit_code"] for p in run["processes"]] == [-15, None]  # e: SIGKILLed, unseen
    assert not any(alive(pid) for pid in pids)


def _wait_gone(*pids: int, timeout: float = 10) -> None:
    wait_until(lambda: not any(alive(pid) for pid in pids), timeout,
               what=f"{pids} to end: {[p for p in pids if alive(p)]} alive")
