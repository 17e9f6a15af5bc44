"""Jobs on a long-lived Dask cluster, end to end: real ``dask scheduler`` and ``dask worker``
processes on loopback, the real ``antdt`` commands in processes of their own, real Parquet,
TorchRec and an MLflow store; processes killed for real."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import mlflow
import pytest
import yaml
from distributed import Client, Event
from distributed.security import Security

from antdt.agent import event_topic
from commands import ANTDT, antdt
from pipeline.bench.processes import DaskProcesses, wait_for_workers
from pipeline.job.config import load_job
from waits import bounded

TRAIN_ROWS = 16_000


def status(address: str, job_id: str, cwd: Path, *tls: str) -> dict[str, Any]:
    """The job's record; ``{"state": "unknown", "rows": {}}`` until it is submitted."""
    result = antdt("status", job_id, "--scheduler", address, *tls, "--json", cwd=cwd,
                   check=False)
    if result.returncode == 2 and f"unknown job {job_id!r}" in result.stderr:
        return {"state": "unknown", "rows": {}}
    assert result.returncode == 0, result.stderr
    record: dict[str, Any] = json.loads(result.stdout)
    return record


def paused(workers: int, rows: int, until: str) -> list[str]:
    """``--set`` arguments that pause each of ``workers`` agents after ``rows`` rows until the
    Dask event ``until`` is set ("never": nobody sets it): the job is midway for sure."""
    faults = ", ".join(f"{{worker: {i}, pause_after_rows: {rows}, pause_until: {until}}}"
                       for i in range(workers))
    return ["--set", f"faults=[{faults}]"]


def wait_paused(client: Client, job_id: str, workers: int) -> None:
    bounded.until(lambda: sum(m.get("fault") == "pause" for _, m in
                              client.get_events(event_topic(job_id))) == workers,
                  "every agent paused")


UNCONTROLLED = ["--set", "train.sharding=pull"]
"""The straggler controller off: it would take an agent paused for seconds for a hung one."""


@pytest.fixture
def job_file(cluster_job: Path) -> Path:
    """The small async job, two epochs, 3 workers' worth of shards."""
    raw = yaml.safe_load(cluster_job.read_text())
    raw["train"].update(epochs=2, shard_rows=1024)
    cluster_job.write_text(yaml.safe_dump(raw))
    return cluster_job


@pytest.fixture
def cluster(process_cluster: DaskProcesses) -> DaskProcesses:
    """The suite's long-lived scheduler and three worker processes, for the tests that kill
    nothing."""
    return process_cluster


@pytest.mark.slow
def test_a_job_outlives_the_client_that_submitted_it(cluster: DaskProcesses, job_file: Path,
                                                     tmp_path: Path) -> None:
    client = subprocess.Popen([ANTDT, "submit", str(job_file), "--scheduler", cluster.address,
                               "--no-wait", "--json"], cwd=tmp_path, stdout=subprocess.PIPE,
                              text=True)
    assert client.stdout is not None
    submitted = json.loads(client.stdout.readline())
    client.send_signal(signal.SIGKILL)  # the submitting process dies at once
    client.wait(timeout=30)
    job_id = submitted["job_id"]

    record = bounded.until(lambda: (r := status(cluster.address, job_id, tmp_path))["state"]
                           in ("finished", "failed", "cancelled") and r, "the job's end")
    assert record["state"] == "finished", record["error"]
    assert record["rows"]["lost"] == 0 and record["rows"]["done"] == 2 * TRAIN_ROWS
    # the job service put the job's page on the scheduler's web server; the submit named it
    assert submitted["page"].startswith("http://127.0.0.1:")
    assert submitted["page"].endswith(f"/antdt/jobs/{job_id}")
    assert status(cluster.address, job_id, tmp_path)["page"] == submitted["page"]
    with urllib.request.urlopen(submitted["page"], timeout=30) as answer:
        page = answer.read().decode()
    assert 'data-final="1"' in page and f"job {job_id}" in page
    job = load_job(job_file)
    mlflow.set_tracking_uri(job.mlflow.tracking_uri)
    run = mlflow.get_run(record["run"]["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.metrics["rows_trained"] == 2 * TRAIN_ROWS
    assert run.data.metrics["auc"] == pytest.approx(record["summary"]["auc"])
    assert run.data.tags["antdt.job_id"] == job_id
    assert mlflow.pyfunc.load_model(f"runs:/{run.info.run_id}/model") is not None
    history = mlflow.MlflowClient().get_metric_history(run.info.run_id, "train.rows_done")
    assert len(history) >= 2 and history[-1].value == 2 * TRAIN_ROWS


def ctrl_c_as_in_a_shell() -> None:
    """In the child before it runs: Ctrl-C as a shell gives it. An ignored SIGINT is inherited
    (something in the test process may have set it so), and Python then installs no
    KeyboardInterrupt handler: the child would never see the Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_ctrl_c_detaches_and_follow_reattaches(cluster: DaskProcesses, job_file: Path,
                                               tmp_path: Path) -> None:
    job_id = go = f"detach-{os.getpid()}"
    following = subprocess.Popen([ANTDT, "submit", str(job_file), "--scheduler",
                                  cluster.address, "--job-id", job_id, *UNCONTROLLED,
                                  *paused(3, 512, until=go)],
                                 cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, preexec_fn=ctrl_c_as_in_a_shell)
    with Client(cluster.address) as client:
        wait_paused(client, job_id, 3)
        following.send_signal(signal.SIGINT)
        _, err = following.communicate(timeout=60)
        Event(go, client=client).set()

    assert following.returncode == 130, err
    assert f"Re-attach with: antdt follow {job_id} --scheduler {cluster.address}" in err
    followed = antdt("follow", job_id, "--scheduler", cluster.address, "--json", cwd=tmp_path)
    summary = json.loads(followed.stdout.splitlines()[-1])
    assert summary["job_id"] == job_id and summary["rows_lost"] == 0
    assert summary["rows_trained"] == 2 * TRAIN_ROWS + summary["rows_retrained"]


@pytest.mark.slow
def test_two_jobs_at_once_one_cancelled_midway(cluster: DaskProcesses, job_file: Path,
                                               tmp_path: Path) -> None:
    # the second job's agents pause after 512 rows each, for an event nobody sets: it is
    # midway, for sure, when it is cancelled
    ids = [f"pair-{os.getpid()}-{name}" for name in ("kept", "cancelled")]
    for job_id, extra in zip(ids, ([], paused(3, 512, until="never"))):
        antdt("submit", str(job_file), "--scheduler", cluster.address, "--no-wait",
              "--job-id", job_id, *extra, cwd=tmp_path)
    bounded.until(lambda: status(cluster.address, ids[1], tmp_path)["rows"].get("trained", 0)
                  > 0, "the second job trains")
    cancelled = antdt("cancel", ids[1], "--scheduler", cluster.address, cwd=tmp_path)
    assert f"cancelling job {ids[1]}" in cancelled.stdout
    followed = antdt("follow", ids[0], "--scheduler", cluster.address, "--json", cwd=tmp_path)
    summary = json.loads(followed.stdout.splitlines()[-1])

    assert summary["rows_trained"] == 2 * TRAIN_ROWS + summary["rows_retrained"]
    assert summary["rows_lost"] == 0 and summary["job_id"] == ids[0]
    record = bounded.until(lambda: (r := status(cluster.address, ids[1], tmp_path))["state"]
                           == "cancelled" and r, "the cancelled job's end")
    assert record["rows"]["lost"] > 0
    mlflow.set_tracking_uri(load_job(job_file).mlflow.tracking_uri)
    assert mlflow.get_run(record["run"]["run_id"]).info.status == "KILLED"
    again = antdt("follow", ids[1], "--scheduler", cluster.address, cwd=tmp_path, check=False)
    assert again.returncode == 1 and "was cancelled" in again.stderr
    listed = json.loads(antdt("status", "--scheduler", cluster.address, "--json",
                              cwd=tmp_path).stdout)
    states = {r["job_id"]: r["state"] for r in listed}
    assert (states[ids[0]], states[ids[1]]) == ("finished", "cancelled")
    logs = antdt("logs", ids[1], "--scheduler", cluster.address, cwd=tmp_path).stdout
    assert "cancelling: cancelled by a client" in logs
    followed_logs = antdt("logs", ids[1], "--follow", "--scheduler", cluster.address,
                          cwd=tmp_path).stdout  # the job has ended: --follow returns
    assert followed_logs == logs


LIGHT = """
import os, runpy, sys
leave = os._exit

def report(code):
    print("heavy:", sorted(name for name in ("torch", "mlflow") if name in sys.modules), code,
          flush=True)
    leave(code)

os._exit, sys.argv = report, ["antdt", *sys.argv[1:]]
runpy.run_path({antdt!r}, run_name="__main__")
"""
"""Runs an ``antdt`` command in this process's place, then names the heavy modules it imported
and its exit status (as it leaves: ``antdt`` ends with ``os._exit``)."""


@pytest.mark.slow
def test_status_logs_cancel_and_follow_import_neither_torch_nor_mlflow(
        cluster: DaskProcesses, job_file: Path, tmp_path: Path) -> None:
    """The commands that only read, follow or cancel a job start in about a second: they
    import neither torch nor MLflow, on a job that runs, ends and does not exist."""
    job_id = f"light-{os.getpid()}"
    antdt("submit", str(job_file), "--scheduler", cluster.address, "--no-wait", "--job-id",
          job_id, *paused(3, 512, until="never"), cwd=tmp_path)
    bounded.until(lambda: status(cluster.address, job_id, tmp_path)["rows"].get("trained", 0)
                  > 0, "the job trains")
    script = LIGHT.format(antdt=ANTDT)
    for args, code, shown in (
            (["status"], 0, job_id), (["status", job_id, "--json"], 0, f'"job_id": "{job_id}"'),
            (["logs", job_id], 0, "registered"), (["cancel", job_id], 0, "cancelling job"),
            (["follow", job_id], 1, "was cancelled"),
            (["status", "no-such-job"], 2, "unknown job 'no-such-job'")):
        done = subprocess.run([sys.executable, "-c", script, *args, "--scheduler",
                               cluster.address], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120,  # piped, the jobs table keeps ids whole
                              env={k: v for k, v in os.environ.items() if k != "COLUMNS"})
        *_, last = done.stdout.splitlines()
        assert last == f"heavy: [] {code}", (args, done.stdout, done.stderr)
        assert shown in done.stdout + done.stderr, (args, done.stdout, done.stderr)


def test_a_bad_job_file_is_refused_before_anything_starts(cluster: DaskProcesses,
                                                         job_file: Path, tmp_path: Path) -> None:
    before = json.loads(antdt("status", "--scheduler", cluster.address, "--json",
                              cwd=tmp_path).stdout)
    bad = ("--set", "train.epochz=2")
    submitted = antdt("submit", str(job_file), "--scheduler", cluster.address, *bad,
                      cwd=tmp_path, check=False)
    trained = antdt("train", str(job_file), "--local", *bad, cwd=tmp_path, check=False)

    assert submitted.returncode == trained.returncode == 2
    assert submitted.stderr == trained.stderr  # the same one line as antdt train
    assert submitted.stderr.count("\n") == 1 and "unknown key(s) ['epochz']" in submitted.stderr
    after = json.loads(antdt("status", "--scheduler", cluster.address, "--json",
                             cwd=tmp_path).stdout)
    assert [r["job_id"] for r in after] == [r["job_id"] for r in before]  # nothing started


@pytest.mark.slow
def test_killed_workers_cost_no_row(medium_job: Path, tmp_path: Path) -> None:
    """One worker process SIGKILLed mid-job (its nanny starts a new one) and another worker
    killed with its nanny: the job finishes with no row lost, as good as a fault-free run."""
    rows = 2 * 300_000
    with DaskProcesses(tmp_path) as processes:
        three = processes.add_workers(3)
        alone = processes.add_workers(1)
        wait_for_workers(processes.address, 4)
        baseline = json.loads(antdt("submit", str(medium_job), "--scheduler", processes.address,
                                    "--json", cwd=tmp_path).stdout.splitlines()[-1])
        # every agent pauses after 40,000 rows until the kills are done: they happen mid-job
        go = f"killed-{os.getpid()}"
        job = subprocess.Popen([ANTDT, "submit", str(medium_job), "--scheduler",
                                processes.address, "--json", "--job-id", "faulty",
                                *paused(4, 40_000, until=go)],
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
        with Client(processes.address) as client:
            wait_paused(client, "faulty", 4)
            processes.worker_processes(three)[0].kill()  # its nanny starts a new worker process
            processes.kill_group(alone)  # a nanny and its worker, together
            Event(go, client=client).set()
            out, err = job.communicate(timeout=240)
        assert job.returncode == 0, f"{err}\n{processes.logs()}"
    summary = json.loads(out.splitlines()[-1])
    assert summary["rows_lost"] == 0 and baseline["rows_lost"] == 0
    assert summary["rows_trained"] == rows + summary["rows_retrained"]
    assert summary["auc"] == pytest.approx(baseline["auc"], abs=0.01)
    mlflow.set_tracking_uri(load_job(medium_job).mlflow.tracking_uri)
    assert mlflow.get_run(summary["run_id"]).data.metrics["agents_dead"] == 2


def test_dask_knows_the_antdt_commands() -> None:
    dask = str(Path(sys.executable).parent / "dask")
    result = subprocess.run([dask, "antdt", "submit", "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--no-wait" in result.stdout and "--tls-ca-file" in result.stdout


def write_certificates(folder: Path) -> tuple[str, str, str]:
    """A CA and one certificate it signed for 127.0.0.1 (every process uses it), as files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import ipaddress

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "antdt test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(days=1))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
                critical=False)
            .sign(ca_key, hashes.SHA256()))
    folder.mkdir(exist_ok=True)
    paths = (folder / "ca.pem", folder / "cert.pem", folder / "key.pem")
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(paths[0]), str(paths[1]), str(paths[2])


@pytest.mark.slow
def test_tls_jobs_and_a_client_without_certificates_is_refused(job_file: Path,
                                                               tmp_path: Path) -> None:
    ca, cert, key = write_certificates(tmp_path)
    tls = ("--tls-ca-file", ca, "--tls-cert", cert, "--tls-key", key)
    security = Security(tls_ca_file=ca, tls_client_cert=cert, tls_client_key=key,
                        require_encryption=True)
    go = f"secure-{os.getpid()}"
    with DaskProcesses(tmp_path, tls=(ca, cert, key)) as processes:
        processes.add_workers(2)
        assert processes.address.startswith("tls://")
        wait_for_workers(processes.address, 2, security=security)
        job = subprocess.Popen([ANTDT, "submit", str(job_file), "--scheduler",
                                processes.address, *tls, "--json", "--job-id", "secure",
                                *UNCONTROLLED, *paused(2, 512, until=go)],
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
        with Client(processes.address, security=security) as client:
            wait_paused(client, "secure", 2)  # the job runs while strangers knock
            refused = antdt("status", "secure", "--scheduler", processes.address,
                            cwd=tmp_path, check=False)
            assert refused.returncode == 2
            assert f"cannot reach the scheduler at {processes.address}: it speaks TLS" \
                in refused.stderr
            stranger_ca, stranger_cert, stranger_key = write_certificates(tmp_path / "stranger")
            refused = antdt("status", "secure", "--scheduler", processes.address,
                            "--tls-ca-file", stranger_ca, "--tls-cert", stranger_cert,
                            "--tls-key", stranger_key, cwd=tmp_path, check=False,
                            env={"DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "5s"})
            assert refused.returncode == 2
            assert f"cannot reach the scheduler at {processes.address}" in refused.stderr
            Event(go, client=client).set()
        out, err = job.communicate(timeout=240)
        assert job.returncode == 0, f"{err}\n{processes.logs()}"
    summary = json.loads(out.splitlines()[-1])
    assert summary["rows_lost"] == 0 and summary["job_id"] == "secure"
    assert summary["rows_trained"] == 2 * TRAIN_ROWS + summary["rows_retrained"]


@pytest.mark.slow
def test_a_password_in_the_tracking_uri_is_never_shown_or_logged(
        cluster: DaskProcesses, job_file: Path, tmp_path: Path, mlflow_server: str) -> None:
    secret = "s3cret-pa55"
    uri = mlflow_server.replace("http://", f"http://ann:{secret}@")
    job_id = f"secret-{os.getpid()}"
    submitted = antdt("submit", str(job_file), "--scheduler", cluster.address, "--job-id",
                      job_id, "--tracking-uri", uri, "--json", cwd=tmp_path)
    summary = json.loads(submitted.stdout.splitlines()[-1])
    assert summary["tracking_uri"] == mlflow_server.replace("http://", "http://ann:***@")

    shown = [submitted.stdout, submitted.stderr,
             antdt("status", job_id, "--scheduler", cluster.address, "--json",
                   cwd=tmp_path).stdout,
             antdt("status", "--scheduler", cluster.address, cwd=tmp_path).stdout,
             antdt("logs", job_id, "--scheduler", cluster.address, cwd=tmp_path).stdout,
             cluster.logs()]
    run = mlflow.MlflowClient(mlflow_server).get_run(summary["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params and run.data.tags.get("antdt.job_id") == job_id
    shown += [json.dumps(run.data.params), json.dumps(run.data.tags)]
    assert not [text for text in shown if secret in text]
