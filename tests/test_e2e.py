"""End to end as a user runs it: a real ``prefect server``, the work pools, ``prefect deploy --all``
from the repo root's prefect.yaml, a real process worker, and a pipeline run triggered through the
API with JSON parameters; an invalid spec is rejected by the server, naming the field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from hypothesis import HealthCheck, given, settings
from prefect import get_client
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.actions import DeploymentScheduleCreate
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterKey,
    DeploymentFilter,
    DeploymentFilterId,
    FlowRunFilter,
    FlowRunFilterExpectedStartTime,
    FlowRunFilterId,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.client.schemas.objects import Log
from prefect.client.schemas.schedules import IntervalSchedule
from prefect.exceptions import PrefectHTTPStatusError
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.states import Cancelled, Cancelling, Scheduled

from deployments.run import Run
from deployments.spec import TrainingSpec
from tasks.keys import artifact_key
from tessera.register import REPO_ROOT
from tests.fault_report import FaultRow, record
from tests.pipeline_specs import tiny_spec_dict
from tests.prefect_server import CPU_WORKER, server_env, start_process, stop_process
from tests.test_spec_properties import mutated_specs, server_accepts
from trainer.checkpoint.commit import list_checkpoints
from trainer.data.card import read_card
from trainer.metrics import read_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.dist]
RUN_TIMEOUT_S = 420
# Specs posted per suite run; TESSERA_HTTP_FUZZ_EXAMPLES=2000 for a full pass through the HTTP door.
HTTP_FUZZ_EXAMPLES = int(os.environ.get("TESSERA_HTTP_FUZZ_EXAMPLES", "150"))


@pytest.fixture(scope="module")
def client(prefect_server: str) -> Iterator[SyncPrefectClient]:
    with temporary_settings({PREFECT_API_URL: prefect_server}), get_client(sync_client=True) as api:
        yield api


def cli(env: dict[str, str], *args: str) -> str:
    result = subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (
        f"{' '.join(args)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    )
    return result.stdout


@pytest.fixture(scope="module")
def deployed(
    prefect_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[dict[str, str], Path]]:
    """Pools created, every deployment of prefect.yaml deployed, a worker polling tessera-cpu."""
    home = tmp_path_factory.mktemp("prefect-client")
    env = server_env(prefect_server, home)
    cli(env, sys.executable, "-m", "tessera.cli", "deploy", "--no-write")  # pools, deployments, sealed
    runs = tmp_path_factory.mktemp("runs")
    worker_env = {**env, "TESSERA_RUNS_DIR": str(runs), "PREFECT_WORKER_QUERY_SECONDS": "1"}
    log = home / "worker.log"
    worker = start_process(CPU_WORKER, worker_env, log)
    try:
        yield env, runs
    finally:
        stop_process(worker)
        print(log.read_text()[-5000:])  # shown by pytest only when a test failed


def deployment_id(client: SyncPrefectClient, name: str) -> object:
    return client.read_deployment_by_name(name).id


def test_every_deployment_is_registered_with_its_pool_and_schema(
    client: SyncPrefectClient, deployed: object
) -> None:
    pools = {p.name: p.type for p in client.read_work_pools()}
    assert pools == {
        "tessera-cpu": "process",
        "tessera-gpu": "kubernetes",
        "tessera-tpu": "kubernetes",
        "tessera-trainium": "kubernetes",
    }
    pipeline = client.read_deployment_by_name("train-pipeline/local-cpu")
    assert pipeline.work_pool_name == "tessera-cpu" and pipeline.parameters["spec"]["name"] == "tiny-local"
    schema = pipeline.parameter_openapi_schema
    cluster = schema["definitions"]["ClusterSpec"]["properties"]
    assert cluster["accelerator"]["enum"] == ["cpu", "gpu", "tpu", "trainium"]
    assert (
        cluster["nodes"]["minimum"] == 1
        and cluster["nodes"]["default"] == 1
        and cluster["nodes"]["description"]
    )
    tpu = client.read_deployment_by_name("train-pipeline/tpu-llama3-70b-v5p")
    assert tpu.work_pool_name == "tessera-tpu" and tpu.job_variables["image"].endswith(":tpu")
    nightly = client.read_deployment_by_name("train-pipeline/nightly")
    assert nightly.schedules[0].schedule.cron == "0 3 * * *"
    assert client.read_deployment_by_name("evaluate-checkpoints/local-cpu").schedules[0].schedule.interval


def test_invalid_spec_is_rejected_by_the_server_and_launches_nothing(
    client: SyncPrefectClient, deployed: tuple[dict[str, str], Path], tmp_path: Path
) -> None:
    bad = tiny_spec_dict(tmp_path, "e2e-bad", cluster={"accelerator": "fpga"})
    pipeline = deployment_id(client, "train-pipeline/local-cpu")
    with pytest.raises(PrefectHTTPStatusError) as rejected:
        client.create_flow_run_from_deployment(pipeline, parameters={"spec": bad})
    assert rejected.value.response.status_code in (409, 422) and "accelerator" in rejected.value.response.text
    runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[pipeline])))
    assert not [r for r in runs if r.parameters.get("spec", {}).get("name") == "e2e-bad"]
    assert not (deployed[1] / "e2e-bad").exists()


def test_an_unknown_top_level_parameter_is_refused_by_the_server_naming_it(
    client: SyncPrefectClient, deployed: tuple[dict[str, str], Path], tmp_path: Path
) -> None:
    spec = tiny_spec_dict(tmp_path, "e2e-unknown")
    pipeline = deployment_id(client, "train-pipeline/local-cpu")
    with pytest.raises(PrefectHTTPStatusError) as rejected:
        client.create_flow_run_from_deployment(pipeline, parameters={"spec": spec, "stpes": 30})
    assert rejected.value.response.status_code in (409, 422) and "stpes" in rejected.value.response.text
    assert not (deployed[1] / "e2e-unknown").exists()


@settings(
    max_examples=HTTP_FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(case=mutated_specs())
def test_the_server_refuses_exactly_what_the_schema_check_refuses(
    client: SyncPrefectClient, deployed: object, case: tuple[dict[str, Any], str]
) -> None:
    """The Prefect API door over HTTP: each generated spec is created as a flow run (scheduled a day
    out, so no worker takes it, then deleted) or refused with a 4xx, as the property tests predict."""
    spec, _ = case
    try:
        spec = json.loads(json.dumps(spec, allow_nan=False))
    except ValueError:
        return  # NaN and infinities cannot travel as JSON at all
    pipeline = deployment_id(client, "train-pipeline/local-cpu")
    later = Scheduled(scheduled_time=datetime.now(UTC) + timedelta(days=1))
    try:
        run = client.create_flow_run_from_deployment(pipeline, parameters={"spec": spec}, state=later)
    except PrefectHTTPStatusError as refused:
        assert refused.response.status_code in (409, 422), refused.response.text
        assert not server_accepts(spec), f"the server refused what the schema accepts: {spec}"
        return
    client.delete_flow_run(run.id)
    assert server_accepts(spec), f"the server accepted what the schema refuses: {spec}"


# Parameter sets the deployment's JSON schema refuses at submission (HTTP 409/422 naming the field) ...
REFUSED_AT_SUBMISSION = {
    "control character in checkpoint.url": ({"checkpoint": {"url": "ckpt\nx"}}, "url"),
    "optimizer.lr 1e300": ({"optimizer": {"lr": 1e300}}, "lr"),
    "write_bandwidth_gbps 1e-300": ({"checkpoint": {"write_bandwidth_gbps": 1e-300}}, "write_bandwidth_gbps"),
}
# ... and those only the flow's own check can refuse (rules across fields, or beyond JSON schema): the run
# fails in its parameter check, before any task, with the spec error as its state and its log's one line.
REFUSED_BY_THE_FLOW = {
    "dp_shard 3 on 2 chips": ({"parallel": {"dp_shard": 3}}, "make the degrees multiply to the chip count"),
    "seq_len 1e9": ({"train": {"seq_len": 1e9}}, "train.seq_len: Input should be a valid integer"),
    "output_url leaving the directory": ({"data": {"output_url": "../x"}}, "leaves the working directory"),
    "unknown protocol": ({"checkpoint": {"url": "nosuch://b/x"}}, "nosuch:// is not a storage protocol"),
    "warmup past the run": ({"optimizer": {"warmup_steps": 50}}, "optimizer.warmup_steps=50 exceeds"),
}


def run_logs(client: SyncPrefectClient, flow_run_id: UUID) -> list[Log]:
    return client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))


def test_a_spec_validate_refuses_is_refused_at_submission_or_fails_its_run_in_one_line(
    client: SyncPrefectClient, deployed: tuple[dict[str, str], Path], tmp_path: Path
) -> None:
    """One door, through the real server and worker: what JSON schema can say is refused when the run
    is created; the rest fails the run before data preparation, in one line, with no traceback."""
    pipeline = deployment_id(client, "train-pipeline/local-cpu")
    base = tiny_spec_dict(tmp_path, "e2e-door", steps=4, interval=2)
    for case, (patch, field) in REFUSED_AT_SUBMISSION.items():
        spec = {**base, **{k: {**base.get(k, {}), **v} for k, v in patch.items()}}
        with pytest.raises(PrefectHTTPStatusError) as refused:
            client.create_flow_run_from_deployment(pipeline, parameters={"spec": spec})
        assert refused.value.response.status_code in (409, 422) and field in refused.value.response.text, case
    runs = {}
    for case, (patch, _) in REFUSED_BY_THE_FLOW.items():
        spec = {**base, **{k: {**base.get(k, {}), **v} for k, v in patch.items()}}
        runs[case] = client.create_flow_run_from_deployment(pipeline, parameters={"spec": spec}).id
    deadline = time.monotonic() + RUN_TIMEOUT_S
    for case, (_, message) in REFUSED_BY_THE_FLOW.items():
        while not (run := client.read_flow_run(runs[case])).state.is_final():
            assert time.monotonic() < deadline, f"{case}: flow run still {run.state.name}"
            time.sleep(1)
        assert run.state.is_failed() and message in run.state.message, (case, run.state.message)
        assert not client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
        # Logs reach the server after the final state: wait for the run's last record, the engine's exit
        # line, which Prefect logs with a traceback and the filter turns into the refusal.
        logs = run_logs(client, run.id)
        while not any(
            log.name == "prefect.flow_runs" and log.message.startswith("spec is invalid: ") for log in logs
        ):
            assert time.monotonic() < deadline, (
                f"{case}: no one-line refusal in {[log.message for log in logs]}"
            )
            time.sleep(1)
            logs = run_logs(client, run.id)
        refusals = [log.message for log in logs if log.message.startswith("spec is invalid: ")]
        assert all(message in line and "\n" not in line for line in refusals), (case, refusals)
        assert not any("Traceback" in log.message for log in logs), (case, [log.message for log in logs])
    assert not (tmp_path / "data").exists() and not list(deployed[1].glob("e2e-door-*"))


def test_a_from_hf_path_resolves_in_the_flow_run_a_worker_starts(
    client: SyncPrefectClient, deployed: tuple[dict[str, str], Path], tmp_path: Path
) -> None:
    """model.from_hf is relative to the working directory: the flow run the worker starts runs in the
    checkout (prefect deploy's pull step), so the shipped config.json resolves there. Refused only
    once the file is read (its Qwen3 q/k norms under tp=2), so nothing trains and the refusal proves it."""
    spec = tiny_spec_dict(tmp_path, "e2e-from-hf", parallel={"dp_shard": 1, "tp": 2})
    spec["model"] = {"from_hf": "deployments/specs/hf/qwen3-tiny/config.json"}
    pipeline = deployment_id(client, "train-pipeline/local-cpu-from-hf")
    run = client.create_flow_run_from_deployment(pipeline, parameters={"spec": spec})
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not (run := client.read_flow_run(run.id)).state.is_final():
        assert time.monotonic() < deadline, f"flow run still {run.state.name}"
        time.sleep(1)
    assert (
        run.state.is_failed() and "model.qk_norm with parallel.tp=2 is not supported" in run.state.message
    ), run.state.message
    assert not list(deployed[1].glob("e2e-from-hf-*"))


def test_pipeline_deployment_run_trains_validates_and_evaluates(
    client: SyncPrefectClient, deployed: tuple[dict[str, str], Path], tmp_path: Path
) -> None:
    # Two torchrun agents on loopback sharing one c10d rendezvous stand in for two nodes.
    spec = tiny_spec_dict(
        tmp_path, "e2e-tiny", steps=6, interval=3, cluster={"nodes": 2, "chips_per_node": 1}
    )
    run = client.create_flow_run_from_deployment(
        deployment_id(client, "train-pipeline/local-cpu"), parameters=json.loads(json.dumps({"spec": spec}))
    )
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not (run := client.read_flow_run(run.id)).state.is_final():
        assert time.monotonic() < deadline, f"flow run still {run.state.name} after {RUN_TIMEOUT_S} s"
        time.sleep(2)
    assert run.state.is_completed(), run.state.message

    manifest = read_card(str(next((tmp_path / "data").glob("*/manifest.json"))))
    assert manifest.totals["train"].shards >= 1 and manifest.totals["val"].samples > 0
    run_dir = deployed[1] / f"e2e-tiny-{run.id.hex[-8:]}"
    assert [(m.step, m.status) for m in list_checkpoints(str(run_dir / "checkpoints"))] == [
        (3, "validated"),
        (6, "validated"),
    ]
    assert sorted(p.name for p in (run_dir / "evals").glob("*.json")) == [
        "step-000003.json",
        "step-000006.json",
    ]
    keys = {artifact_key(run_dir.name, k) for k in ("plan", "progress", "eval", "loss-curve", "report")}
    artifacts = client.read_artifacts(
        artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=sorted(keys)))
    )
    assert {a.key for a in artifacts} == keys


def test_scheduled_runs_of_one_deployment_each_train_a_run_of_their_own(
    client: SyncPrefectClient, deployed: tuple[dict[str, str], Path], tmp_path: Path
) -> None:
    """What the scheduler does (a Scheduled flow run of the deployment, same parameters), twice: two
    runs that both train from step 1, not a second one that finds the first's checkpoints and stops."""
    spec = tiny_spec_dict(tmp_path, "e2e-sched", steps=2, interval=2, eval={"enabled": False})
    pipeline = deployment_id(client, "train-pipeline/local-cpu")
    scheduled = [
        client.create_flow_run_from_deployment(
            pipeline, parameters=json.loads(json.dumps({"spec": spec})), state=Scheduled()
        )
        for _ in range(2)
    ]
    deadline = time.monotonic() + RUN_TIMEOUT_S
    for flow_run in scheduled:
        while not (flow_run := client.read_flow_run(flow_run.id)).state.is_final():
            assert time.monotonic() < deadline, (
                f"flow run still {flow_run.state.name} after {RUN_TIMEOUT_S} s"
            )
            time.sleep(2)
        assert flow_run.state.is_completed(), flow_run.state.message
    run_dirs = sorted(deployed[1].glob("e2e-sched-*"))
    assert [p.name for p in run_dirs] == sorted(f"e2e-sched-{r.id.hex[-8:]}" for r in scheduled)
    for run_dir in run_dirs:
        assert [line["step"] for line in read_metrics(run_dir / "metrics.jsonl")] == [1, 2]
        assert json.loads((run_dir / "status.json").read_text())["resumed_from"] is None


def test_twenty_runs_scheduled_within_a_minute_get_twenty_run_ids_and_directories(
    client: SyncPrefectClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deployment with `--interval 3` (as `prefect deployment schedule create` makes it): the server's
    scheduler makes 20 flow runs for the first minute, with time-ordered ids that share their first
    digits. Each still opens a run and a directory of its own. The schedule starts a day ahead and the
    deployment has no pool, so nothing trains: the names are what is tested."""
    spec = tiny_spec_dict(tmp_path, "e2e-twenty")
    start = (datetime.now(UTC) + timedelta(days=1)).replace(microsecond=0)
    every_3_s = IntervalSchedule(interval=timedelta(seconds=3), anchor_date=start)
    deployment = client.create_deployment(
        client.create_flow_from_name("train-pipeline"),
        "twenty-in-a-minute",
        schedules=[DeploymentScheduleCreate(schedule=every_3_s, active=True)],
        parameters=json.loads(json.dumps({"spec": spec})),
    )
    try:
        end = start + timedelta(seconds=59)
        window = {"start_time": start.isoformat(), "end_time": end.isoformat()}
        client.request("POST", "/deployments/{id}/schedule", path_params={"id": deployment}, json=window)
        # The server's scheduler service may schedule the active schedule meanwhile too (seen once under
        # load: 100 more runs, from now on, a day before this minute). Do what it does, and read only
        # this minute's runs.
        client.request("POST", "/deployments/{id}/schedule", path_params={"id": deployment}, json={})
        scheduled = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                expected_start_time=FlowRunFilterExpectedStartTime(after_=start, before_=end)
            ),
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment])),
        )
        assert len(scheduled) == 20 and len({r.id.hex[:8] for r in scheduled}) < 20  # the old ids' digits
        monkeypatch.setenv("TESSERA_RUNS_DIR", str(tmp_path / "runs"))
        loaded = TrainingSpec.model_validate(spec)
        runs = [Run.open(loaded, token=str(r.id)) for r in scheduled]  # as each one's open-run task does
        assert len({run.run_id for run in runs}) == 20
        assert len(list((tmp_path / "runs").glob("e2e-twenty-*/run.json"))) == 20
    finally:
        client.delete_deployment(deployment)


def trainer_processes(run_dir: Path) -> list[int]:
    """Live torchrun agents and ranks whose command line names ``run_dir``."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and str(run_dir).encode() in argv and b"torch.distributed.run" in argv:
            found.append(int(proc.name))
    return found


@pytest.mark.fault
def test_cancelling_a_flow_run_stops_every_trainer_process_within_seconds(
    client: SyncPrefectClient, deployed: tuple[dict[str, str], Path], tmp_path: Path
) -> None:
    """`prefect flow-run cancel` (or the UI's Cancel): the worker ends the flow run's process, and its
    torchrun agents and ranks follow it (parent-death signal, then torchrun stops its ranks)."""
    spec = tiny_spec_dict(tmp_path, "e2e-cancel", steps=5000, interval=1000, eval={"enabled": False})
    flow_run = client.create_flow_run_from_deployment(
        deployment_id(client, "train-pipeline/local-cpu"), parameters=json.loads(json.dumps({"spec": spec}))
    )
    run_dir = deployed[1] / f"e2e-cancel-{flow_run.id.hex[-8:]}"
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not read_metrics(run_dir / "metrics.jsonl"):
        assert time.monotonic() < deadline, "training never started"
        time.sleep(0.5)
    assert trainer_processes(run_dir)
    client.set_flow_run_state(flow_run.id, Cancelling())
    cancelled_at = time.monotonic()
    while trainer_processes(run_dir):
        assert time.monotonic() - cancelled_at < 60, "trainer processes outlived the cancelled flow run"
        time.sleep(0.5)
    stopped_s = time.monotonic() - cancelled_at
    while not (flow_run := client.read_flow_run(flow_run.id)).state.is_final():
        assert time.monotonic() < deadline
        time.sleep(0.2)
    final_s = time.monotonic() - cancelled_at
    print(
        f"cancel requested -> trainers stopped: {stopped_s:.1f} s; -> {flow_run.state.name}: {final_s:.1f} s"
    )
    assert flow_run.state.is_cancelled(), flow_run.state
    # The log ends with the engine's own last line, which names the final state (Prefect's engine once
    # logged "Finished in state Running()" here, the worker setting Cancelled ~20 s later). Logs reach
    # the server after the state: wait for that line.
    logged_by = time.monotonic() + 60  # logs are sent in batches every 2 s; 60 s for a busy 2-core box
    while not (logs := [log.message for log in run_logs(client, flow_run.id)]) or not logs[-1].startswith(
        "Finished in state"
    ):
        assert time.monotonic() < logged_by, logs[-5:]
        time.sleep(1)
    assert logs[-1].startswith("Finished in state Cancelled("), logs[-5:]
    assert not any("Traceback" in line for line in logs), logs
    record(
        FaultRow(
            "flow run cancelled (Prefect API)",
            "recovered",
            "trainers stopped",
            round(stopped_s, 1),
            None,
            None,
            None,
        )
    )


def test_submit_overrides_a_few_fields_of_the_deployments_spec(
    client: SyncPrefectClient, deployed: tuple[dict[str, str], Path]
) -> None:
    """`tessera submit --set` merges into the deployment's spec (not Prefect's replace-the-whole-spec),
    validates locally, and creates the flow run; a bad override is refused before anything is created."""
    env, _ = deployed
    pipeline = client.read_deployment_by_name("train-pipeline/local-cpu")
    out = cli(
        env, sys.executable, "-m", "tessera.cli", "submit", "train-pipeline/local-cpu",
        "--set", "train.steps=6", "--set", "optimizer.lr=1e-3", "--set", "name=e2e-submit",
    )  # fmt: skip
    flow_run_id = UUID(out.split("(", 1)[1].split(")", 1)[0])
    client.set_flow_run_state(flow_run_id, Cancelled(), force=True)  # the parameters are the subject here
    spec = client.read_flow_run(flow_run_id).parameters["spec"]
    assert (spec["train"]["steps"], spec["optimizer"]["lr"], spec["name"]) == (6, 1e-3, "e2e-submit")
    deployed_spec = pipeline.parameters["spec"]
    assert spec["data"]["max_documents"] == deployed_spec["data"]["max_documents"]  # kept, not defaulted
    assert spec["train"]["seq_len"] == deployed_spec["train"]["seq_len"]
    refused = subprocess.run(
        [sys.executable, "-m", "tessera.cli", "submit", "train-pipeline/local-cpu", "--set", "parallel.tp=3"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode == 1 and "parallel.tp=3 must divide model.n_heads" in refused.stderr
    assert "Traceback" not in refused.stderr
