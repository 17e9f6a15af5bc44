"""Training one job: in this process (:mod:`pipeline.training.local`) or on a Dask cluster
(:mod:`pipeline.training.cluster`: the spec, the recipes and hooks it hands AntDT, and following
the job to its end). Imports :mod:`pipeline.job` and :mod:`pipeline.tracking`."""
