"""Where a default fit's time goes: validation, statistics, passes, curvature, steps.

For each problem (``bench_time_to_optimum.py``'s synthetic ones) it fits
scikit-learn's solver at its defaults (lbfgs, Ridge for least squares)
and CA-SGD at its defaults, interleaved, each from a quiet machine
(``bench_time_to_optimum.SETTLE``), and
prints the median wall time of each and of the stages of CA-SGD's fit,
timed by wrapping the engine's functions in this process:

* ``preconditioner``: SVRG's column statistics (``jacobi_preconditioner``);
* ``smoothness``: the row norms and the largest eigenvalue behind the step
  (``loss_smoothness``; absent where Newton epochs need none);
* ``passes``: the full passes that measure the objective and take SVRG's
  snapshot (``full_pass``);
* ``curvature``: forming and factoring Newton's system (``form_newton_system``);
* ``rest``: validation, planning, the minibatch steps and the result.

``--numpy-blas threaded`` adds CA-SGD with numpy's BLAS left at its own
thread count during the fit (``sklearn_casgd._distributed.threads``), side by side.

    python benchmarks/bench_fit_stages.py
    python benchmarks/bench_fit_stages.py --families poisson --n 4e5 --d 28,100 --repeats 5
    python benchmarks/bench_fit_stages.py --numpy-blas single,threaded --csv stages.csv
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import defaultdict

from _table import print_table, write_csv
from bench_time_to_optimum import SETTLE, Problem, scikit_learn_solvers, synthetic

import sklearn_casgd._engine.fit_plan as fit_plan
import sklearn_casgd._engine.solver as solver_module
import sklearn_casgd._estimators._base as estimator_base
from sklearn_casgd._registry import FAMILIES

STAGES = {
    "preconditioner": (fit_plan, "jacobi_preconditioner"),
    "smoothness": (fit_plan, "loss_smoothness"),
    "passes": (solver_module, "full_pass"),
    "curvature": (solver_module, "form_newton_system"),
}


def problem(family: str, n: int, d: int, alpha: float):
    """``(X, y, CA-SGD estimator, scikit-learn's estimator)``: bench_time_to_optimum's problem."""
    X, y = synthetic(family, n, d)
    first = next(iter(scikit_learn_solvers(Problem(family, family, X, y, alpha)).values()))
    return X, y, FAMILIES[family].estimator(alpha=alpha), first


class StageClock:
    """Seconds spent in each of :data:`STAGES` while it is installed."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._originals = {}

    def install(self) -> None:
        for stage, (module, name) in STAGES.items():
            original = getattr(module, name)
            self._originals[stage] = original
            setattr(module, name, self._timed(stage, original))

    def _timed(self, stage, function):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[stage] += time.perf_counter() - start

        return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="logistic,poisson,linear")
    parser.add_argument("--n", default="1e5")
    parser.add_argument("--d", default="28,100")
    parser.add_argument("--alpha", type=float, default=1e-4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--numpy-blas", default="single", help="single and/or threaded")
    parser.add_argument("--settle", type=float, default=SETTLE, help="seconds before each fit")
    parser.add_argument("--csv")
    args = parser.parse_args()
    arms = args.numpy_blas.split(",")
    clock = StageClock()
    clock.install()
    single_threaded = estimator_base.numpy_blas_single_threaded

    header = ["problem", "scikit-learn s", "numpy BLAS", "CA-SGD s", "vs scikit-learn", "plan"]
    header += [*STAGES, "rest"]
    rows = []
    for family in args.families.split(","):
        for n in (int(float(v)) for v in args.n.split(",")):
            for d in (int(v) for v in args.d.split(",")):
                X, y, estimator, reference = problem(family, n, d, args.alpha)
                estimator.fit(X, y)  # first fit of the shape: not timed
                reference_times, times, stages = [], defaultdict(list), defaultdict(list)
                for _ in range(args.repeats):
                    time.sleep(args.settle)
                    start = time.perf_counter()
                    reference.fit(X, y)
                    reference_times.append(time.perf_counter() - start)
                    for arm in arms:
                        estimator_base.numpy_blas_single_threaded = (
                            single_threaded if arm == "single" else contextlib.nullcontext
                        )
                        clock.seconds.clear()
                        time.sleep(args.settle)
                        start = time.perf_counter()
                        estimator.fit(X, y)
                        total = time.perf_counter() - start
                        times[arm].append(total)
                        for stage in STAGES:
                            stages[arm, stage].append(clock.seconds[stage])
                        stages[arm, "rest"].append(total - sum(clock.seconds.values()))
                estimator_base.numpy_blas_single_threaded = single_threaded
                plan = estimator.fit_stats_["plan"]
                how = "Newton" if plan["newton"] else f"b={estimator.fit_stats_['batch_size']}"
                reference_seconds = statistics.median(reference_times)
                for arm in arms:
                    seconds = statistics.median(times[arm])
                    rows.append(
                        [
                            f"{family} {n:.0e} x {d}",
                            f"{reference_seconds:.3f}",
                            arm,
                            f"{seconds:.3f}",
                            f"{seconds / reference_seconds:.2f}x",
                            f"{how}, {estimator.n_iter_}",
                            *(
                                f"{statistics.median(stages[arm, stage]):.3f}"
                                for stage in [*STAGES, "rest"]
                            ),
                        ]
                    )
    print_table(header, rows)
    if args.csv:
        write_csv(args.csv, header, rows)


if __name__ == "__main__":
    main()
