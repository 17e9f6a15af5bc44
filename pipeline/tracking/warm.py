"""Work MLflow does once per process, done where a process imports this module: the fork server
of a command's LocalCluster (:func:`pipeline.training.local_cluster.worker_modules`), whose
worker processes inherit it instead of each paying for it while a job waits, and a local job
while it trains (:class:`pipeline.training.local.OpeningRun`).

Logging a model checks its pip requirements against the installed packages
(``mlflow.utils.requirements_utils``), which first maps every installed distribution to its
modules: about 0.6 s of a core, on the critical path of a job's end. MLflow keeps that map in the
module; a version of MLflow without the function is left alone.
"""

from __future__ import annotations

from mlflow.utils import requirements_utils

getattr(requirements_utils, "_init_packages_to_modules_map", lambda: None)()
