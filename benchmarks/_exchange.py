"""Benchmarks' way to force how a distributed fit's ranks exchange an outer iteration."""

from __future__ import annotations

import contextlib
import dataclasses

import sklearn_casgd._estimators._base as estimator_base

EXCHANGES = ("all-reduce", "all-gather")


@contextlib.contextmanager
def forced_exchange(exchange):
    """Fits inside take ``exchange`` for their outer iterations ("auto": their own choice).

    Sets the plan's private ``exchange`` field, which the workers honour.
    """
    if exchange == "auto":
        yield
        return
    original = estimator_base.plan_fit

    def plan(*args, **kwargs):
        fit_plan, *rest = original(*args, **kwargs)
        return (dataclasses.replace(fit_plan, exchange=exchange), *rest)

    estimator_base.plan_fit = plan
    try:
        yield
    finally:
        estimator_base.plan_fit = original
