"""The LocalCluster a command starts (:mod:`pipeline.training.local_cluster`): begun at once,
its workers forked from a server that imported the stack, while the command itself imports
none of it; and ``-v`` telling where a command's seconds went."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from commands import antdt

PROBE = """
import os, sys
from pipeline.training.local_cluster import connect

def state():
    return ("torch" in sys.modules, "mlflow" in sys.modules, os.environ.get("OMP_NUM_THREADS"),
            os.getppid() != CLIENT)


def imported():
    return ("torch" in sys.modules, "mlflow" in sys.modules)

CLIENT = int(os.environ.setdefault("PROBE_CLIENT", str(os.getpid())))

if __name__ == "__main__":
    assert "torch" not in sys.modules and "mlflow" not in sys.modules, "imported early"
    with connect(2, preload=["pipeline.training.recipes", "pipeline.tracking.warm"]) as client:
        print(sorted(set(client.run(state).values())))
    print(imported())
"""


def test_workers_fork_from_a_server_that_imported_the_stack_the_client_did_not(
        tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=240, env={"PYTHONWARNINGS": "ignore", "PATH": "/usr/bin"},
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    workers, client = done.stdout.strip().splitlines()[-2:]
    # every worker has torch and MLflow before any task ran, and Dask's one OpenMP thread, and
    # is the fork server's child, not this process's (where a spawned worker's nanny lives)
    assert workers == "[(True, True, '1', True)]"
    # the client process imported neither
    assert client == "(False, False)"


def test_verbose_train_says_where_the_seconds_went(tmp_path: Path, job_file: Path) -> None:
    result = antdt("-v", "train", str(job_file), "--local", cwd=tmp_path)
    phases = [line for line in result.stderr.splitlines() if line.startswith("phases")]
    assert phases and "start" in phases[0] and "training" in phases[0] \
        and "model" in phases[0], result.stderr[-2000:]
    assert "s of it outside training" in result.stderr
