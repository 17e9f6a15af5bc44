"""The ``antdt`` command line (:mod:`pipeline.cli.main`, with the job and experiment commands and
``antdt simulate``): thin over the rest of :mod:`pipeline`, which never imports it."""
