"""A job's config in (:mod:`pipeline.job.config`) and its summary out (:mod:`pipeline.job.report`):
the vocabulary every other part of :mod:`pipeline` speaks. Imports none of them."""
