"""Work made of many jobs: a sweep over a grid of a job's settings (:mod:`pipeline.workflows.sweep`)
and the daily retraining the Airflow DAG runs (:mod:`pipeline.workflows.retrain`). Imports
:mod:`pipeline.job`, :mod:`pipeline.tracking`, :mod:`pipeline.training` and
:mod:`pipeline.terminal`."""
