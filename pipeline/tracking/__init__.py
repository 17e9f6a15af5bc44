"""MLflow: a job's run (:mod:`pipeline.tracking.tracking`), its timeline PNG, the logged model
(:mod:`pipeline.serving`), the registry's versions and champion, runs compared side by
side. Imports only :mod:`pipeline.job` and the logged model's module."""
