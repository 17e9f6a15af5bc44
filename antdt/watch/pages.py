"""The live job pages and their JSON API, on the Dask scheduler's own web server (the one that
serves its dashboard and ``/metrics``): no server of antdt's own, and nothing loaded from the
internet (the timeline is SVG drawn here, the refresh a few lines of inline script).

=========================  =======================================================================
``/antdt/``                the jobs: state, progress, rows/s, workers and flagged ones, elapsed
``/antdt/jobs/<id>``       one job: state, progress, rows/s, elapsed time, a row per worker (pace,
                           classification, backlog, restarts, last report), the lease timeline so
                           far, the recent controller actions, the tracking run; it refreshes
                           itself every :data:`REFRESH_S` until the job ended
``/antdt/api/jobs``        the list as JSON (:func:`antdt.watch.view.job_row` per job)
``/antdt/api/jobs/<id>``   one job as JSON (:func:`antdt.watch.view.job_view`); 404 for an
                           unknown id
=========================  =======================================================================

The data comes from the job service (``scheduler.plugins["antdt-jobs"]``), looked up at every
request: before the first job, or once the plugin was unregistered, the pages answer 503 with a
message saying so (the JSON API ``{"error": ...}``), never a 500. Everything shown is escaped
(the templates' autoescape; the SVG escapes its own text): job names and tags are user input.

How the pages get on the web server (handlers cannot be removed from a running tornado
application, so each way checks the pages are not there already):

* :class:`~antdt.jobs.service.JobService` adds them when it starts (:func:`add_routes`), on
  every scheduler a job runs on, however the scheduler was started (a LocalCluster, ``dask
  scheduler``): from the first job on. Routes added at runtime ignore ``--dashboard-prefix``.
* ``dask scheduler --preload antdt.watch.pages`` adds them as the scheduler starts
  (:func:`dask_setup`), so ``/antdt/`` answers before the first job.
* this module in Dask's ``distributed.scheduler.http.routes`` setting (the list of Dask's own
  route modules plus this one): read when the scheduler is made, under its
  ``--dashboard-prefix``.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import urllib.parse
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from distributed import Scheduler
from distributed.http.utils import RequestHandler
from distributed.metrics import time
from tornado import template, web

from antdt.jobs.spec import PLUGIN_NAME
from antdt.watch.timeline import timeline_svg
from antdt.watch.urls import JOBS_PATH, job_path, redact_all
from antdt.watch.view import job_row, job_view

if TYPE_CHECKING:
    from antdt.jobs.runner import JobRunner

REFRESH_S = 2.0
"""How often a page of a job that has not ended reloads its content."""


def run_link(run: Mapping[str, Any] | None) -> str | None:
    """The tracking run's page in the MLflow UI, when its tracking URI is an MLflow server's
    (``http(s)://``; its user part left out); None for a file or database store, which has no
    page of its own."""
    if not run or not str(run.get("tracking_uri", "")).startswith(("http://", "https://")):
        return None
    parts = urllib.parse.urlsplit(str(run["tracking_uri"]))
    base = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2],
                                                  query="", fragment="")).rstrip("/")
    return f"{base}/#/experiments/{run['experiment_id']}/runs/{run['run_id']}"


# ---- the handlers -----------------------------------------------------------------------------


class _Handler(RequestHandler):
    """What every page and API call shares: the scheduler (``server``, handed in by Dask as
    ``dask_server``), its job service's runners (looked up at every request: without a
    service the request ends here, 503 with a message) and the answers that say what is
    missing, as a page or, for the API (``api``), as JSON. ``root`` leads from the page to the
    web server's root (or its prefix): the pages link to Dask's own by relative paths."""

    server: Scheduler
    runners: Mapping[str, JobRunner]
    api = False
    root = "../"

    def prepare(self) -> None:
        runners = getattr(self.server.plugins.get(PLUGIN_NAME), "runners", None)
        if not isinstance(runners, dict):
            self.missing(503, "no antdt job service", NO_SERVICE)
            return
        self.runners = runners

    def runner(self, job_id: str) -> JobRunner | None:
        """Job ``job_id``'s runner; None once a 404 answered that there is none."""
        runner = self.runners.get(job_id)
        if runner is None:
            self.missing(404, "unknown job", f"No job {job_id!r} on this scheduler: finished "
                         "jobs stay listed until it restarts (the newest antdt.jobs.history "
                         "of them).", jobs=sorted(self.runners)[-20:])
        return runner

    def missing(self, status: int, title: str, message: str, **extra: Any) -> None:
        if self.api:
            self.json(status, {"error": message, **extra})
        else:
            self.page(status, "message.html", title=title, message=message)

    def json(self, status: int, body: Any) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json; charset=UTF-8")
        self.set_header("Cache-Control", "no-store")
        self.finish(json.dumps(body, default=str))

    async def json_off_loop(self, body: Any) -> None:
        """Answer 200 with ``body`` as JSON, encoded in a thread: a job's view is bounded, but
        encoding it need not hold the scheduler's event loop."""
        text = await asyncio.to_thread(lambda: json.dumps(redact_all(body), default=str))
        self.set_header("Content-Type", "application/json; charset=UTF-8")
        self.set_header("Cache-Control", "no-store")
        self.finish(text)

    def page(self, status: int, name: str, final: bool = True, **values: Any) -> None:
        """Render template ``name``; a page that is not ``final`` reloads its content every
        :data:`REFRESH_S`."""
        self.set_status(status)
        self.set_header("Cache-Control", "no-store")
        self.finish(self.render_page(name, final, **values))

    def render_page(self, name: str, final: bool = True, **values: Any) -> bytes:
        return PAGES.load(name).generate(root=self.root, final=final,
                                         refresh_ms=int(REFRESH_S * 1000), **FORMATS, **values)


class JobsPage(_Handler):
    def get(self) -> None:
        now = time()
        self.page(200, "jobs.html", title="antdt jobs", final=False,
                  jobs=redact_all([job_row(r, now) for r in reversed(list(self.runners.values()))]))


class JobPage(_Handler):
    root = "../../"

    async def get(self, job_id: str) -> None:
        """The job's view is read on the event loop (a bounded amount: :func:`job_view`); its
        timeline and page are drawn in a thread."""
        runner = self.runner(job_id)
        if runner is None:
            return
        view = job_view(runner, time())
        self.set_header("Cache-Control", "no-store")
        self.finish(await asyncio.to_thread(self.draw, job_id, view))

    def draw(self, job_id: str, view: dict[str, Any]) -> bytes:
        """The page of job ``job_id``'s ``view``, its timeline as SVG (the password of every
        URL in it shown as ``***``)."""
        view = redact_all(view)
        timeline = view["timeline"]
        return self.render_page("job.html", view["final"], title=f"job {job_id}", job=view,
                                run_link=run_link(view["run"]),
                                timeline_svg=timeline_svg(timeline["lanes"], timeline["spans"],
                                                          timeline["marks"], timeline["now"]))


class JobsApi(_Handler):
    api = True

    def get(self) -> None:
        now = time()
        self.json(200, redact_all({"jobs": [job_row(r, now) for r in self.runners.values()]}))


class JobApi(_Handler):
    api = True

    async def get(self, job_id: str) -> None:
        runner = self.runner(job_id)
        if runner is not None:
            await self.json_off_loop({"job": job_view(runner, time())})


NO_SERVICE = ("This scheduler has no antdt job service: no antdt job was submitted since it "
              "started, or the service's plugin was unregistered. Submit one with antdt "
              "submit JOB.yaml --scheduler ADDRESS.")

routes: list[tuple[str, type[web.RequestHandler], dict[str, Any]]] = [
    ("antdt", web.RedirectHandler, {"url": "antdt/"}),
    (JOBS_PATH, JobsPage, {}),
    (r"antdt/jobs/([^/]+)", JobPage, {}),
    (r"antdt/api/jobs", JobsApi, {}),
    (r"antdt/api/jobs/([^/]+)", JobApi, {}),
]
"""The pages as Dask's ``distributed.scheduler.http.routes`` setting takes a module's routes
(``(pattern, handler, kwargs)``, relative to the prefix; Dask hands the handlers
``dask_server``)."""


def add_routes(scheduler: Scheduler) -> bool:
    """Serve the pages on ``scheduler``'s web server (at its root) unless it serves them
    already (from the routes setting, a preload, an earlier job service); whether they were
    added now. Dask's dashboard links to them either way (:func:`link_from_dashboard`)."""
    link_from_dashboard(scheduler)
    application = getattr(scheduler, "http_application", None)
    if not isinstance(application, web.Application) or _serves(application.default_router):
        return False
    application.add_handlers(r".*$", [
        ("/" + pattern, handler,
         {**kwargs, "dask_server": scheduler} if issubclass(handler, _Handler) else kwargs)
        for pattern, handler, kwargs in routes])
    return True


def link_from_dashboard(scheduler: Scheduler) -> bool:
    """Put "Antdt" in the navigation bar of Dask's dashboard pages (``/status``, ``/workers``...):
    whether it was added now. Dask has no setting for it; its Bokeh application renders every
    page with the bar's list of pages that ``distributed.dashboard.scheduler.template_variables``
    keeps for the scheduler (memoized, the same list object), and a relative ``antdt`` there
    leads to ``/antdt`` under any prefix. Not an interface Dask promises: where it is missing (no
    bokeh, another Dask) nothing is linked, and antdt's pages still link to Dask's."""
    try:
        from distributed.dashboard.scheduler import template_variables
        pages = template_variables(scheduler).get("pages")
    except (ImportError, AttributeError, TypeError):  # no bokeh, or Dask's internals moved
        return False
    if not isinstance(pages, list) or "antdt" in pages:
        return False
    pages.append("antdt")
    return True


def dask_setup(scheduler: Scheduler) -> None:
    """``dask scheduler --preload antdt.watch.pages``: the pages from the scheduler's start."""
    add_routes(scheduler)


def _serves(router: Any) -> bool:
    """Whether a rule of ``router`` (or of a router inside it) leads to the jobs' page."""
    return any(rule.target is JobsPage or _serves(rule.target)
               for rule in getattr(router, "rules", ()))


# ---- the templates ----------------------------------------------------------------------------


def _number(value: float | int | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _seconds(value: float | None) -> str:
    """``75.2`` -> ``1 min 15 s``."""
    if value is None:
        return "-"
    minutes, seconds = divmod(int(value), 60)
    hours, minutes = divmod(minutes, 60)
    return (f"{hours} h {minutes} min" if hours else f"{minutes} min {seconds} s" if minutes
            else f"{value:.1f} s")


def _clock(at: float | None) -> str:
    return "-" if not at else datetime.datetime.fromtimestamp(at).strftime("%H:%M:%S")


FORMATS = {"number": _number, "seconds": _seconds, "clock": _clock, "job_path": job_path}
"""What the templates format values with."""

_BASE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{{ title }} - antdt</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 0 1.5em 2em; color: #222; }
nav { padding: .6em 0; border-bottom: 1px solid #ddd; margin-bottom: 1em; }
nav a { margin-right: 1.2em; }
table { border-collapse: collapse; margin: .5em 0 1.5em; }
th, td { border-bottom: 1px solid #e4e4e4; padding: .25em .7em; text-align: left; }
td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; }
.state { font-weight: 600; }
.cls-straggler { background: #E69F00; color: black; font-weight: 600; }
.cls-hung { background: #D55E00; color: white; font-weight: 600; }
.error { color: #b00020; }
.muted { color: #777; }
progress { width: 20em; }
svg.timeline text { font: 11px system-ui, sans-serif; fill: #333; }
</style></head>
<body>
<nav><a href="{{ root }}antdt/">antdt jobs</a><a href="{{ root }}status">Dask dashboard</a>
<a href="{{ root }}info/main/workers.html">Dask workers</a></nav>
<main id="live" data-final="{{ 1 if final else 0 }}">{% block main %}{% end %}</main>
<p id="refresh" class="muted"></p>
<script>
(function () {
  function tick() {
    var live = document.getElementById("live");
    if (!live || live.dataset.final === "1") { return; }
    fetch(window.location.href, {cache: "no-store"}).then(function (answer) {
      return answer.text().then(function (text) {
        var fresh = new DOMParser().parseFromString(text, "text/html").getElementById("live");
        if (fresh) { live.replaceWith(fresh); }
        document.getElementById("refresh").textContent = answer.ok ? "" :
          "the scheduler answered " + answer.status;
      });
    }, function (error) {
      document.getElementById("refresh").textContent = "the scheduler is unreachable: " + error;
    }).then(function () { window.setTimeout(tick, {{ refresh_ms }}); });
  }
  window.setTimeout(tick, {{ refresh_ms }});
})();
</script>
</body></html>
"""

_MESSAGE = """{% extends "base.html" %}{% block main %}
<h1>{{ title }}</h1><p id="message">{{ message }}</p>
{% end %}"""

_JOBS = """{% extends "base.html" %}{% block main %}
<h1>antdt jobs</h1>
{% if not jobs %}<p id="message">No job yet.</p>{% else %}
<table id="jobs"><tr><th>job</th><th>name</th><th>state</th><th class="n">rows done</th>
<th class="n">rows/s</th><th class="n">workers</th><th class="n">flagged</th>
<th class="n">elapsed</th><th>submitted</th></tr>
{% for job in jobs %}<tr data-job="{{ job['job_id'] }}">
<td><a href="{{ job_path(job['job_id']).removeprefix('antdt/') }}">{{ job['job_id'] }}</a></td>
<td>{{ job['name'] }}</td><td class="state">{{ job['state'] }}</td>
<td class="n">{{ number(job['progress']['rows_done']) }} /
{{ number(job['progress']['rows_expected']) }}</td>
<td class="n">{{ number(job['rows_per_s']) }}</td><td class="n">{{ job['workers'] }}</td>
<td class="n">{{ job['flagged'] }}</td><td class="n">{{ seconds(job['elapsed_s']) }}</td>
<td>{{ clock(job['submitted_at']) }}</td></tr>{% end %}
</table>{% end %}
<p class="muted">As JSON: <a href="../antdt/api/jobs">/antdt/api/jobs</a></p>
{% end %}"""

_JOB = """{% extends "base.html" %}{% block main %}
{% set progress = job['progress'] %}
<h1>job {{ job['job_id'] }} <span class="muted">{{ job['name'] }}</span></h1>
<table id="summary">
<tr><th>state</th><td class="state" id="state">{{ job['state'] }}</td></tr>
<tr><th>progress</th><td><progress max="1" value="{{ '%.4f' % progress['fraction'] }}">
</progress> <span id="rows-done" data-rows="{{ progress['rows_done'] }}">
{{ number(progress['rows_done']) }}</span> / {{ number(progress['rows_expected']) }} rows
({{ '%.1f' % (100 * progress['fraction']) }} %), epoch {{ progress['epoch'] }} of
{{ progress['epochs'] }}</td></tr>
<tr><th>throughput</th><td id="rows-per-s">{{ number(job['rows_per_s']) }} rows/s</td></tr>
<tr><th>elapsed</th><td>{{ seconds(job['elapsed_s']) }} (submitted
{{ clock(job['submitted_at']) }}; {{ job['mode'] }} mode)</td></tr>
<tr><th>MLflow run</th><td id="run">{% if run_link %}<a href="{{ run_link }}">
{{ job['run']['run_id'] }}</a>{% elif job['run'] %}{{ job['run']['run_id'] }}
<span class="muted">in {{ job['run'].get('tracking_uri', '') }}</span>{% else %}-{% end %}
</td></tr>
{% if job['error'] %}<tr><th>error</th><td class="error">{{ job['error'] }}</td></tr>{% end %}
{% if job['record']['stopped'] %}<tr><th>stopped</th><td>{{ job['record']['stopped'] }}</td>
</tr>{% end %}
</table>
<h2>Workers</h2>
<table id="workers"><tr><th>agent</th><th>worker</th><th>state</th><th class="n">rows/s</th>
<th>classification</th><th class="n">batch time (peers)</th><th class="n">backlog rows</th>
<th class="n">restarts</th><th class="n">last report</th><th class="n">rows</th></tr>
{% for w in job['workers'] %}<tr data-worker="{{ w['worker'] }}">
<td>{{ w['label'] }}</td><td>{{ w['worker'] }}</td><td>{{ w['agent'] }}</td>
<td class="n">{{ number(w['rows_per_s']) }}</td>
<td class="classification cls-{{ w['classification'] }}">{{ w['classification'] }}
{% if w['verdict'] and w['verdict'] != w['classification'] %}({{ w['verdict'] }}){% end %}
{% if w['waiting'] is not None and w['waiting'] >= 0.5 and w['classification'] != 'ok' %}<span
class="waiting">{{ '%.0f' % (100 * w['waiting']) }}% waiting</span>{% end %}</td>
<td class="n">{% if w['batch_time_s'] is not None %}{{ '%.0f' % (1000 * w['batch_time_s']) }} ms
{% if w['median_batch_time_s'] is not None %}({{ '%.0f' % (1000 * w['median_batch_time_s']) }}
ms){% end %}{% else %}-{% end %}</td>
<td class="n">{{ number(w['backlog_rows']) }}</td><td class="n">{{ w['restarts'] }}</td>
<td class="n">{% if w['last_report_s'] is not None %}{{ seconds(w['last_report_s']) }} ago
{% else %}-{% end %}</td><td class="n">{{ number(w['rows']) }}</td></tr>{% end %}
</table>
{% if job['record'].get('tables') %}{% set tables = job['record']['tables'] %}
<h2>Sharded tables</h2>
<p id="tables">{{ number(tables['rows']) }} rows in {{ tables['buckets'] }} buckets, each with a
primary and a backup; map epoch {{ tables['epoch'] }}, {{ tables['moves'] }} bucket(s) copied
{% if tables['lost'] %}<span class="error">, {{ len(tables['lost']) }} lost</span>{% end %}.</p>
<table id="buckets"><tr><th>worker</th><th class="n">primary</th><th class="n">backup</th>
<th class="n">pull ms</th><th class="n">push ms</th><th class="n">pushes in flight</th>
<th class="n">waited for the bound</th></tr>
{% for worker, held in tables['held'].items() %}{% set seen = job['tables_seen'].get(worker) or {} %}
<tr><td>{{ worker }}</td><td class="n">{{ held['primary'] }}</td>
<td class="n">{{ held['backup'] }}</td>
<td class="n">{% if 'pull_ms' in seen %}{{ '%.1f' % seen['pull_ms'] }}{% else %}-{% end %}</td>
<td class="n">{% if 'push_ms' in seen %}{{ '%.1f' % seen['push_ms'] }}{% else %}-{% end %}</td>
<td class="n">{{ seen.get('inflight', '-') }}</td>
<td class="n">{% if 'waited_s' in seen %}{{ seconds(seen['waited_s']) }}{% else %}-{% end %}
</td></tr>{% end %}</table>{% end %}
<h2>Lease timeline</h2>
{% if job['timeline']['spans_total'] > len(job['timeline']['spans']) %}<p class="muted"
id="merged">{{ number(job['timeline']['spans_total']) }} leases in
{{ number(len(job['timeline']['spans'])) }} bars: a worker's neighbouring leases with the same
outcome are drawn as one.</p>{% end %}
{% raw timeline_svg %}
<h2>Controller actions</h2>
<p class="muted">{{ job['actions_total'] }} in all{% if job['actions'] %}, the last
{{ len(job['actions']) }}{% end %}.</p>
{% if job['actions'] %}<table id="actions"><tr><th>time</th><th>action</th><th>worker</th>
<th class="n">rows</th><th>reason</th></tr>
{% for a in reversed(job['actions']) %}<tr><td>{{ clock(a['time']) }}</td>
<td>{{ a['action'] }}</td><td>{{ a['worker'] }}</td><td class="n">{{ number(a['rows']) }}</td>
<td>{{ a['reason'] }}</td></tr>{% end %}</table>{% end %}
<p class="muted">As JSON: <a href="../api/jobs/{{ job_path(job['job_id']).rpartition('/')[2] }}">
/antdt/api/jobs/{{ job['job_id'] }}</a></p>
{% end %}"""

PAGES = template.DictLoader({"base.html": _BASE, "message.html": _MESSAGE, "jobs.html": _JOBS,
                             "job.html": _JOB})
"""The pages' templates (autoescaped: every ``{{ }}`` is HTML-escaped)."""
