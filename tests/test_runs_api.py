"""/v1/runs on a live hub, with real processes: start order and health waits,
the model channel the trainer gets (and nothing else keeps), failures with exit code
and log path, completion, and stopping in reverse order."""

from __future__ import annotations

import base64
import json
import os
import pwd
import sys
from datetime import datetime
from pathlib import Path

import pytest

from app.runs.logs import TAIL_MAX_BYTES
from tests.support.hubs import write_config
from tests.support.processes import run_cli
from tests.support.runs import (
    KEY_ENV,
    RunsEnv,
    alive,
    free_port,
    run_tables,
    spec,
    start,
    wait_status,
)

pytestmark = pytest.mark.process


def test_runs_are_refused_unless_enabled(runs_env: RunsEnv) -> None:
    hub = runs_env.hub(enabled=False)
    with hub.client() as client:
        for response in (
            client.post("/v1/runs", json=spec(runs_env.child("t"))),
            client.get("/v1/runs"),
            client.get("/v1/runs/abc"),
            client.delete("/v1/runs/abc"),
        ):
            assert response.status_code == 403
            error = response.json()["error"]
            assert error["code"] == "runs_disabled"
            assert "runs.enabled" in error["message"]
    assert not runs_env.events()


def test_bad_specs_and_unknown_runs_get_json_errors(runs_env: RunsEnv) -> None:
    hub = runs_env.hub()
    with hub.client() as client:
        cases = [
            ({"environments": []}, "trainer"),
            ({"trainer": {"command": []}}, "trainer.command"),
            ({"trainer": {"command": ["x"], "health": {"http": "http://a", "log": "up"}}},
             "trainer.health"),
            ({"trainer": {"command": ["x"], "health": {"alive_seconds": 5}, "start_timeout": 2}},
             "trainer"),
            ({"trainer": {"command": ["x"]}, "env": {"OPENAI_API_KEY": "mine"}}, "env"),
            ({"trainer": {"command": ["x"]}, "poll_interval": 0}, "poll_interval"),
            ({"trainer": {"command": ["x"]}, "cwd": "/no/such/dir"}, "cwd"),
            ({"trainer": {"command": ["x"]}, "cwd": "/tmp\x00/etc"}, "cwd"),
            ({"trainer": {"command": ["x"]}, "cwd": "/tmp/" + "d" * 300}, "cwd"),
            ({"trainer": {"command": ["x"]}, "cwd": "/tmp/" + "d/" * 3000}, "cwd"),
            ({"trainer": {"command": ["x\x00y"]}}, "trainer.command.0"),
            ({"trainer": {"command": ["x"]}, "env": {"A": "b\x00"}}, "env.A"),
        ]
        for body, field in cases:
            response = client.post("/v1/runs", json=body)
            assert response.status_code == 422, (body, response.text)
            assert response.json()["error"]["field"] == field, response.text
        assert client.get("/v1/runs/nope").status_code == 404
        assert client.delete("/v1/runs/nope").json()["error"]["code"] == "not_found"
        assert client.get("/v1/runs/nope?tail=-1").status_code == 422
        assert client.get("/v1/runs").json() == {"runs": []}


def test_start_order_health_checks_and_reverse_stop(runs_env: RunsEnv) -> None:
    """The trainer (http check) first; env_0 (log check) once the trainer answers;
    env_1 (alive_seconds) once env_0 printed its line. DELETE stops env_1, env_0, the
    trainer, in that order; env_0 ignores SIGTERM and gets SIGKILL after stop_timeout."""
    port = free_port()
    hub = runs_env.hub()
    body = spec(
        runs_env.child("trainer", "--serve", port, "--serve-after", 0.6),
        runs_env.child("env0", "--say", "READY", "--say-after", 0.4, "--ignore-sigterm"),
        runs_env.child("env1"),
        trainer_health={"http": f"http://127.0.0.1:{port}/health"},
        env_health=[{"log": "READY"}, {"alive_seconds": 1}],
        stop_timeout=1,
    )
    with hub.client() as client:
        run_id = start(client, body)
        run = wait_status(client, run_id, "running")
        t = runs_env.event_time
        assert t("trainer", "serving") < t("env0", "start")
        assert t("env0", "said") < t("env1", "start")
        # alive_seconds: env_1 was waited for before the run counted as running.
        env1 = run["processes"][2]
        waited = _at(env1["healthy_at"]) - _at(env1["started_at"])
        assert env1["role"] == "env_1" and waited.total_seconds() >= 1
        assert [p["role"] for p in run["processes"]] == ["trainer", "env_0", "env_1"]
        pids = [p["pid"] for p in run["processes"]]
        assert all(alive(pid) for pid in pids)
        for p in run["processes"]:
            assert Path(p["log_path"]) == runs_env.logs_dir / f"{p['role']}_{run_id}.log"

        stopping = client.delete(f"/v1/runs/{run_id}")
        assert stopping.status_code == 202 and stopping.json()["status"] == "stopping"
        run = wait_status(client, run_id, "stopped")
    assert t("env1", "sigterm") < t("env0", "sigterm") < t("trainer", "sigterm")
    # env_0 shrugged SIGTERM off: the trainer was asked only after env_0's stop_timeout.
    assert t("trainer", "sigterm") - t("env0", "sigterm") >= 0.9
    codes = {p["role"]: p["exit_code"] for p in run["processes"]}
    assert codes == {"trainer": -15, "env_0": -9, "env_1": -15}
    assert not any(alive(pid) for pid in pids)
    assert run["error_message"] is None and run["finished_at"]
    with hub.client() as client:
        assert client.delete(f"/v1/runs/{run_id}").status_code == 409


def test_the_trainer_gets_the_model_channel_and_nothing_keeps_it(runs_env: RunsEnv) -> None:
    hub = runs_env.hub()
    trainer_env, env0_env = runs_env.tmp / "trainer.env", runs_env.tmp / "env0.env"
    body = spec(
        runs_env.child("trainer", "--env-out", trainer_env),
        runs_env.child("env0", "--env-out", env0_env),
        trainer_health={"log": "trainer started"},
        env_health=[{"log": "env0 started"}],
        env={"RUN_SETTING": "42"},
    )
    with hub.client() as client:
        run_id = start(client, body)
        responses = [client.get(f"/v1/runs/{run_id}").text]
        wait_status(client, run_id, "running")
        responses += [
            client.get(f"/v1/runs/{run_id}?tail=50").text,
            client.get("/v1/runs").text,
            client.delete(f"/v1/runs/{run_id}").text,
        ]
        wait_status(client, run_id, "stopped")

    seen = json.loads(trainer_env.read_text())
    assert seen["OPENAI_API_KEY"] == runs_env.model_key
    assert seen["TINKER_API_KEY"] == runs_env.tinker_key
    assert seen["OPENAI_BASE_URL"] == "http://127.0.0.1:9/api/v1"
    assert seen["ATROPOS_HUB_URL"] == hub.url
    assert seen["RUN_SETTING"] == "42" and seen["PYTHONUNBUFFERED"] == "1"
    assert KEY_ENV not in seen  # the key arrives under the name the trainer reads
    env0 = json.loads(env0_env.read_text())
    assert env0["ATROPOS_HUB_URL"] == hub.url and env0["RUN_SETTING"] == "42"
    assert not {"OPENAI_API_KEY", "TINKER_API_KEY", KEY_ENV, "OPENAI_BASE_URL"} & env0.keys()

    logs = [p.read_text() for p in runs_env.logs_dir.iterdir()]
    places = {"hub log": hub.log, "run tables": run_tables(runs_env.trace_server),
              "process logs": "\n".join(logs), "responses": "\n".join(responses)}
    for secret in (runs_env.model_key, runs_env.tinker_key):
        for place, text in places.items():
            assert secret not in text, f"a key is in the {place}"


def test_a_trainer_that_fails_fails_the_run_with_code_and_log(runs_env: RunsEnv) -> None:
    """It prints its key, then exits 3: the run fails saying so, the environment is
    stopped, and the log tail the API serves has the key blacked out."""
    hub = runs_env.hub()
    body = spec(
        runs_env.child("trainer", "--print-env", "OPENAI_API_KEY", "--exit-after", 1.5,
                       "--code", 3),
        runs_env.child("env0"),
    )
    with hub.client() as client:
        run_id = start(client, body)
        run = wait_status(client, run_id, "failed")
        trainer, env0 = run["processes"]
        assert trainer["exit_code"] == 3
        assert run["error_message"] == f"Trainer exited with code 3. Check {trainer['log_path']}"
        assert env0["exit_code"] == -15 and not alive(env0["pid"])
        shown = client.get(f"/v1/runs/{run_id}?tail=2").json()["processes"][0]["log_tail"]
        assert shown == ["trainer started", "OPENAI_API_KEY is [redacted]"]
        assert runs_env.model_key in Path(trainer["log_path"]).read_text()  # its own doing
        # 64 MB without a newline: ?tail=1 read all of it, and answered all of it.
        with open(trainer["log_path"], "ab") as log:
            for _ in range(64):
                log.write(b"x" * 2**20)
            log.write(b"the end")
        r = client.get(f"/v1/runs/{run_id}?tail=1")
        (line,) = r.json()["processes"][0]["log_tail"]
        assert line.endswith("the end") and len(line) == TAIL_MAX_BYTES
        assert len(r.content) < 2 * TAIL_MAX_BYTES
    assert runs_env.model_key not in hub.log


def test_an_environment_that_exits_fails_the_run(runs_env: RunsEnv) -> None:
    hub = runs_env.hub()
    body = spec(runs_env.child("trainer"), runs_env.child("env0", "--exit-after", 1, "--code", 0))
    with hub.client() as client:
        run = wait_status(client, start(client, body), "failed")
    env0 = run["processes"][1]
    assert run["error_message"] == (
        f"Environment env_0 exited with code 0. Check {env0['log_path']}"
    )
    assert run["processes"][0]["exit_code"] == -15


def test_a_trainer_that_exits_0_completes_the_run(runs_env: RunsEnv) -> None:
    hub = runs_env.hub()
    body = spec(runs_env.child("trainer", "--exit-after", 1), runs_env.child("env0"))
    with hub.client() as client:
        run_id = start(client, body)
        run = wait_status(client, run_id, "completed")
        assert [r["status"] for r in client.get("/v1/runs?status=completed").json()["runs"]] == [
            "completed"
        ]
    assert run["error_message"] is None
    assert [p["exit_code"] for p in run["processes"]] == [0, -15]
    assert f"run {run_id}: completed" in hub.log


def test_start_failures_say_why(runs_env: RunsEnv) -> None:
    hub = runs_env.hub()
    with hub.client() as client:
        # Dies before its health check passes.
        dies = start(client, spec(runs_env.child("t1", "--exit-after", 0.3, "--code", 7),
                                  trainer_health={"log": "never printed"}))
        # Never gets healthy: start_timeout.
        slow = start(client, spec(runs_env.child("t2"), runs_env.child("never"),
                                  trainer_health={"log": "never printed"}, start_timeout=1))
        # Not a program at all.
        missing = start(client, spec(["/no/such/program"]))
        run = wait_status(client, dies, "failed")
        log_path = run["processes"][0]["log_path"]
        assert run["error_message"] == (
            f"Trainer exited with code 7 before it was healthy. Check {log_path}"
        )
        run = wait_status(client, slow, "failed")
        log_path = run["processes"][0]["log_path"]
        assert run["error_message"] == (
            "Trainer not healthy after 1 s: no output line contained 'never printed'. "
            f"Check {log_path}"
        )
        assert len(run["processes"]) == 2 and run["processes"][1]["pid"] is None
        assert run["processes"][0]["exit_code"] == -15
        run = wait_status(client, missing, "failed")
        assert run["error_message"].startswith("Trainer exited with code 127")
        tail = client.get(f"/v1/runs/{missing}?tail=5").json()["processes"][0]["log_tail"]
        assert "cannot start '/no/such/program'" in tail[-1]
    assert "never" not in {e["name"] for e in runs_env.events()}


def _at(iso: str) -> datetime:
    return datetime.fromisoformat(iso)


def test_runs_user_keeps_the_processes_out_of_the_hubs_environment(runs_env: RunsEnv) -> None:
    """A run's processes, as the hub's own user, can read /proc/PID/environ of the hub
    and so the model keys the environments are not given. With runs.user
    (the hub runs as root) they run as that user and cannot."""
    if os.geteuid() != 0:
        pytest.skip("runs.user needs the hub to run as root")

    def peek(hub_pid: int) -> list[str]:
        return ["/bin/sh", "-c", f"echo uid $(id -u); if cat /proc/{hub_pid}/environ "
                "> /dev/null 2>&1; then echo 'environ: read'; else echo 'environ: denied'; "
                "fi; exec sleep 60"]

    seen = {}
    for user in (None, "nobody"):
        hub = runs_env.hub_process(user=user)  # its own process, with its own environment
        assert hub.proc is not None
        body = spec(["/bin/sh", "-c", "exec sleep 60"], peek(hub.proc.pid),
                    env_health=[{"log": "environ:"}], cwd="/tmp")
        with hub.client() as client:
            run_id = start(client, body)
            run = wait_status(client, run_id, "running")
            seen[user] = Path(run["processes"][1]["log_path"]).read_text()
            client.delete(f"/v1/runs/{run_id}")
            wait_status(client, run_id, "stopped")
        hub.stop()
    assert "uid 0" in seen[None] and "environ: read" in seen[None]
    assert f"uid {pwd.getpwnam('nobody').pw_uid}" in seen["nobody"]
    assert "environ: denied" in seen["nobody"]


def test_runs_user_must_exist(runs_env: RunsEnv) -> None:
    config = write_config(runs_env.tmp, runs_env.trace_server,
                          runs={"enabled": True, "user": "no-such-user-here"})
    result = run_cli("serve", "--config", str(config))
    assert result.returncode == 2
    assert "runs.user: Value error, no user 'no-such-user-here'" in result.stderr


@pytest.mark.process
def test_log_tails_hide_the_model_key_in_base64_too(runs_env: RunsEnv) -> None:
    """A trainer whose HTTP library logs `Authorization: Basic base64(user:key)`, or
    that dumps its config base64-encoded: the tail showed the key, encoded."""
    hub = runs_env.hub()
    printer = (
        "import base64, os, sys\n"
        "key = os.environ['OPENAI_API_KEY'].encode()\n"
        "for prefix in (b'', b'u', b'ab', b'user:'):\n"
        "    print('Authorization: Basic', base64.b64encode(prefix + key).decode())\n"
        "    print('config', base64.urlsafe_b64encode(b'{\"k\": \"' + prefix + key + b'\"}')"
        ".decode())\n"
        "print('done', flush=True)\n"
    )
    encodings = [
        base64.b64encode(prefix + runs_env.model_key.encode()).decode()
        for prefix in (b"", b"u", b"ab", b"user:")
    ]
    body = spec(["/bin/sh", "-c", f"{sys.executable} -c \"$0\"; exec sleep 60", printer],
                trainer_health={"log": "done"})
    with hub.client() as client:
        run_id = start(client, body)
        wait_status(client, run_id, "running")
        shown = client.get(f"/v1/runs/{run_id}?tail=20").json()["processes"][0]["log_tail"]
        client.delete(f"/v1/runs/{run_id}")
    assert len(shown) == 9 and shown[-1] == "done", shown
    text = "\n".join(shown)
    assert "[redacted]" in text
    for encoded in encodings:  # none of the key's characters in base64 survive, at any offset
        assert encoded[8:-8] not in text, (encoded, text)
    assert all(line.count("[redacted]") == 1 for line in shown[:-1])
