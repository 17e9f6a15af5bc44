"""antdt's settings read through dask config (:mod:`antdt.config`): an override to None is kept,
a dropped key falls back to the packaged default."""

from __future__ import annotations

import dask.config

from antdt import config


def test_a_setting_overridden_to_none_stays_none_and_a_missing_one_is_the_default() -> None:
    with dask.config.set({"antdt.sync.max-staleness": None, "antdt.sync.period": "2 batches"}):
        assert config.get("antdt.sync.max-staleness") is None
        assert config.get("antdt.sync.period") == "2 batches"
    with dask.config.set({"antdt": {}}):  # the keys dropped, as a config reset does
        assert config.get("antdt.sync.period") == config.defaults["antdt"]["sync"]["period"]
