"""How well ``batch_size="auto"`` predicts, and what its choice costs against the best batch.

For each problem (Gaussian and ``make_classification`` data, and
scikit-learn's and statsmodels' datasets, standardized) it fits the
defaults once to read the plan (``fit_stats_["plan"]``: every candidate
batch size with its s and predicted epochs and epoch seconds), then fits
the chosen batch size and its neighbours (a quarter, half, twice and four
times it) at their planned s, ``--repeats`` times interleaved, and prints
predicted against measured epochs and epoch seconds, the measured wall
time of each fit (planning included), and the chosen batch's time over the
best measured one (its regret). Where the defaults run Newton epochs, the
batch weighed is the planner's fastest minibatch candidate. The summary
line gives the medians of the prediction errors (a factor) and of the
regret.

``--calibrate`` prints, instead, the device profile measured here
(``_engine.cost.measure_profile``, the median of ``--repeats`` measurements), in
the form of ``_engine.cost.PROFILES``.

``--families`` prints, instead, per family (Poisson, gamma, logistic,
least squares on Gaussian problems of 1e5-4e5 rows, and the real
datasets): the plan of the defaults (Newton epochs or not, and their
epochs), and the minibatch SVRG epochs predicted at the planner's fastest
minibatch batch against those measured there: the figures behind
``_engine.planner.EPOCHS_LOG_LINK``.

``--sweep`` fits, instead, the epochs model's constants: every problem at
alpha 1/n and 1e-3, batch sizes 4 to 8192 (64 up for the Gaussian
problems, whose small batches take minutes), s = 1, once each; it prints
the epochs of each fit, then the least-squares fit of ``log(epochs)`` by
``log(floor + variance R / (R + b) + steps b / n)`` over the converged
fits, and its median error (long: about an hour here).

    python benchmarks/bench_planner.py [--repeats 3] [--csv planner.csv]
    python benchmarks/bench_planner.py --problems real
    python benchmarks/bench_planner.py --calibrate --repeats 5
    python benchmarks/bench_planner.py --families
    python benchmarks/bench_planner.py --sweep --csv sweep.csv
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from _table import print_table, write_csv
from sklearn.datasets import make_classification
from sklearn.exceptions import ConvergenceWarning
from sklearn.preprocessing import StandardScaler

from sklearn_casgd._engine.cost import DeviceProfile, measure_profile
from sklearn_casgd._engine.precision import PRESETS
from sklearn_casgd._registry import FAMILIES
from sklearn_casgd.datasets import make_glm_data

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

SYNTHETIC = [
    ("logistic", 100_000, 28),
    ("logistic", 100_000, 100),
    ("linear", 100_000, 100),
    ("poisson", 100_000, 28),
    ("multinomial", 50_000, 28),
    ("classification", 100_000, 100),
]


def problems(which: str):
    if which in ("all", "synthetic"):
        for family, n, d in SYNTHETIC:
            if family == "classification":
                X, y = make_classification(n, d, n_informative=d // 2, random_state=0)
                X, family = StandardScaler().fit_transform(X), "logistic"
            else:
                X, y, _ = make_glm_data(family, n, d, random_state=0)
            yield f"{family} {n}x{d}", family, X.astype(np.float32), y
    if which in ("all", "real"):
        from test_real_data import PROBLEMS

        for name, (loader, family) in PROBLEMS.items():
            X, y = loader()
            yield name, family, StandardScaler().fit_transform(X), y


def fit(family, X, y, **params):
    estimator = FAMILIES[family].estimator(alpha=1e-4, random_state=0, **params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        start = time.perf_counter()
        estimator.fit(X, y)
    return estimator, time.perf_counter() - start


def calibrate(repeats: int) -> None:
    measured = [measure_profile(PRESETS["fp32"], torch.device("cpu")) for _ in range(repeats)]
    fields = list(vars(measured[0]))
    median = DeviceProfile(
        **{f: statistics.median(getattr(p, f) for p in measured) for f in fields}
    )
    print(f"# measure_profile, fp32 on the CPU, {torch.get_num_threads()} threads, "
          f"median of {repeats}")  # fmt: skip
    print('    "cpu": DeviceProfile(')
    for f in fields:
        print(f"        {f}={getattr(median, f):.2g},")
    print("    ),")


def sweep(which: str, csv_path: str | None) -> None:
    """Epochs against batch size over the problems; the model's constants fitted to them."""
    from scipy.optimize import least_squares

    measured = []  # (n, b, R, epochs)
    rows = []
    for name, family, X, y in problems(which):
        n = X.shape[0]
        for alpha in (1.0 / n, 1e-3):
            planned = FAMILIES[family].estimator(alpha=alpha, max_iter=1, tol=None).fit(X, y)
            ratio = planned.fit_stats_["plan"]["smoothness_ratio"]
            for b in [4 * 2**k for k in range(12)]:
                if b > n or (n * X.shape[1] >= 1e6 and b < 64):
                    continue
                estimator = FAMILIES[family].estimator(
                    alpha=alpha, batch_size=b, s=1, random_state=0
                )
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", ConvergenceWarning)
                    estimator.fit(X, y)
                converged = estimator.fit_stats_["converged"]
                if converged:
                    measured.append((n, b, ratio, estimator.n_iter_))
                rows.append([name, f"{alpha:.3g}", b, f"{ratio:.1f}", estimator.n_iter_, converged])
                print("  ".join(map(str, rows[-1])), flush=True)
    n, b, ratio, epochs = (np.array(v, dtype=float) for v in zip(*measured, strict=True))

    def residuals(log_constants):
        floor, variance, steps = np.exp(log_constants)
        return np.log(floor + variance * ratio / (ratio + b) + steps * b / n) - np.log(epochs)

    fitted = least_squares(residuals, np.log([5.0, 40.0, 300.0]))
    floor, variance, steps = np.exp(fitted.x)
    error = np.exp(np.median(np.abs(fitted.fun)))
    print(f"\nepochs(b) = {floor:.2g} + {variance:.3g} R / (R + b) + {steps:.3g} b / n "
          f"over {len(measured)} converged fits; median error x{error:.2f}")  # fmt: skip
    if csv_path:
        write_csv(csv_path, ["problem", "alpha", "b", "R", "epochs", "converged"], rows)


FAMILY_PROBLEMS = [
    (family, n, d)
    for family in ("poisson", "gamma", "logistic", "linear")
    for n, d in ((100_000, 28), (100_000, 100), (400_000, 28))
]


def family_epochs(which: str, csv_path: str | None) -> None:
    """Predicted against measured minibatch epochs per family, beside the defaults' plan."""
    header = ["problem", "default plan", "default epochs", "b", "epochs_pred", "epochs",
              "measured / predicted"]  # fmt: skip
    rows = []
    cases = []
    if which in ("all", "synthetic"):
        for family, n, d in FAMILY_PROBLEMS:
            X, y, _ = make_glm_data(family, n, d, random_state=0, dtype="float32")
            cases.append((f"{family} {n}x{d}", family, X, y))
    if which in ("all", "real"):
        cases.extend(problems("real"))
    for name, family, X, y in cases:
        default, _ = fit(family, X, y)
        plan = default.fit_stats_["plan"]
        candidates = plan["candidates"]
        b = min(candidates, key=lambda size: candidates[size]["seconds"])
        minibatch, _ = fit(family, X, y, batch_size=b)
        predicted = candidates[b]["epochs"]
        rows.append([
            name, "Newton" if plan["newton"] else "minibatch", default.n_iter_, b,
            f"{predicted:.1f}", minibatch.n_iter_, f"{minibatch.n_iter_ / predicted:.2f}",
        ])  # fmt: skip
        print("  ".join(map(str, rows[-1])), flush=True)
    print()
    print_table(header, rows)
    if csv_path:
        write_csv(csv_path, header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", choices=["all", "synthetic", "real"], default="all")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calibrate", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--families", action="store_true")
    parser.add_argument("--csv")
    args = parser.parse_args()
    if args.calibrate:
        calibrate(args.repeats)
        return
    if args.families:
        family_epochs(args.problems, args.csv)
        return
    if args.sweep:
        sweep(args.problems, args.csv)
        return
    header = ["problem", "b", "s", "chosen", "epochs_pred", "epochs", "epoch_ms_pred",
              "epoch_ms", "seconds", "converged"]  # fmt: skip
    rows, epoch_errors, time_errors, regrets = [], [], [], []
    for name, family, X, y in problems(args.problems):
        planned, _ = fit(family, X, y)
        plan = planned.fit_stats_["plan"]
        chosen = planned.fit_stats_["batch_size"]
        if plan.get("newton"):  # the default runs Newton epochs: weigh its minibatch pick
            chosen = min(plan["candidates"], key=lambda b: plan["candidates"][b]["seconds"])
        sizes = [b for b in plan["candidates"] if chosen // 4 <= b <= 4 * chosen]
        runs = {b: [] for b in sizes}
        for _ in range(args.repeats):
            for b in sizes:
                s = plan["candidates"][b]["s"]
                estimator, seconds = fit(family, X, y, batch_size=b, s=s)
                stats = estimator.fit_stats_
                epoch = stats["train_seconds"] / max(estimator.n_iter_, 1)
                runs[b].append((seconds, estimator.n_iter_, epoch, stats["converged"]))
        best = min(statistics.median(r[0] for r in runs[b]) for b in sizes)
        for b in sizes:
            seconds = statistics.median(r[0] for r in runs[b])
            epochs = statistics.median(r[1] for r in runs[b])
            epoch = statistics.median(r[2] for r in runs[b])
            predicted = plan["candidates"][b]
            epoch_errors.append(abs(np.log(predicted["epochs"] / epochs)))
            predicted_epoch = predicted["seconds"] / predicted["epochs"]
            time_errors.append(abs(np.log(predicted_epoch / epoch)))
            if b == chosen:
                regrets.append(seconds / best)
            rows.append([
                name, b, predicted["s"], "*" if b == chosen else "",
                f"{predicted['epochs']:.1f}", f"{epochs:g}", f"{1e3 * predicted_epoch:.2f}",
                f"{1e3 * epoch:.2f}", f"{seconds:.3f}", all(r[3] for r in runs[b]),
            ])  # fmt: skip
            print("  ".join(map(str, rows[-1])), flush=True)
    print()
    print_table(header, rows)
    print(
        f"\nmedian prediction error: epochs x{np.exp(np.median(epoch_errors)):.2f}, "
        f"epoch seconds x{np.exp(np.median(time_errors)):.2f}; chosen batch over the best "
        f"measured: median {np.median(regrets):.2f}x, worst {np.max(regrets):.2f}x"
    )
    if args.csv:
        write_csv(args.csv, header, rows)


if __name__ == "__main__":
    main()
