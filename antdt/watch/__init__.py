"""Watching jobs where Dask users already look, through Dask's own extension points and no web
server of antdt's: the scheduler's ``/metrics`` (:mod:`antdt.watch.metrics`, the
``dask_antdt_*`` series Prometheus scrapes) and the job pages under ``/antdt/`` in the
scheduler's web server (:mod:`antdt.watch.pages`: what a person watches, with a JSON API).

The job service (:class:`~antdt.jobs.service.JobService`) plugs them in when it starts; they
read its jobs' runners in place and change nothing.
"""
