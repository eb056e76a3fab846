"""SVRG on sparse text rows: batch size and preconditioning, epochs and seconds to a gap.

On the TF-IDF matrix of ``bench_text.py``'s generated corpus (or the
rcv1 shape, ``--data rcv1``; or scikit-learn's digits and unscaled
breast_cancer in a sparse container, whose columns are stored in most
rows), SVRG fits with ``tol=None`` for
``--epochs`` epochs at each ``--batch-sizes`` value, with the sparse rows
as they are (the default) and Jacobi-preconditioned as a dense X is
(``fit_plan.PRECONDITION_SPARSE``). SVRG's loss curve is the exact
objective at each epoch's full pass, so one fit gives the first epoch at
which the objective is within ``--gap`` (relative) of the optimum (lbfgs at
``tol=1e-10``), and the training seconds to then (``fit_stats_``'s
cumulative ``epoch_seconds``). The steps run in the sparse epoch kernel.

    python benchmarks/bench_sparse_svrg.py [--batch-sizes 4,8,16,64,256] [--csv out.csv]
    python benchmarks/bench_sparse_svrg.py --data breast_cancer --batch-sizes 8 --epochs 1000
"""

from __future__ import annotations

import argparse

import numpy as np
import scipy.sparse as sp
import torch
from _table import print_table, write_csv
from _text_corpus import make_text_corpus
from bench_sparse import rcv1_like
from sklearn.datasets import load_breast_cancer, load_digits
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from threadpoolctl import threadpool_limits

from sklearn_casgd import CASGDLogisticRegression
from sklearn_casgd._engine import fit_plan
from sklearn_casgd.metrics import glm_objective


def training_data(name: str, n_rows: int):
    """The training rows as CSR, and labels."""
    if name == "rcv1":
        return rcv1_like(n_rows, 47_236, 0.0016)
    if name == "digits":  # pixels, 69 % of the rows a column's median
        X, y = load_digits(return_X_y=True)
        return sp.csr_matrix(X / 16.0), y
    if name == "breast_cancer":  # a dense table, unscaled, in a sparse container
        X, y = load_breast_cancer(return_X_y=True)
        return sp.csr_matrix(X), y
    documents, labels = make_text_corpus(n_rows)
    return TfidfVectorizer().fit_transform(documents), labels


def objective(family: str, model, X, y, alpha: float) -> float:
    """The fitted model's training objective (scikit-learn's binary coef_ is one row)."""
    if family == "logistic":
        return glm_objective(family, X, y, model.coef_.ravel(), model.intercept_[0], alpha)
    return glm_objective(family, X, y, model.coef_, model.intercept_, alpha)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", choices=["corpus", "rcv1", "digits", "breast_cancer"], default="corpus"
    )
    parser.add_argument("--rows", type=int, default=37_500)
    parser.add_argument("--alpha", type=float, default=1e-5)
    parser.add_argument("--batch-sizes", default="4,8,16,64,256")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--gap", type=float, default=1e-4)
    parser.add_argument("--csv")
    args = parser.parse_args()
    X, y = training_data(args.data, args.rows)
    n_rows = X.shape[0]
    optimum = LogisticRegression(C=1.0 / (n_rows * args.alpha), tol=1e-10, max_iter=10_000)
    optimum.fit(X, y)
    family = "multinomial" if len(np.unique(y)) > 2 else "logistic"
    best = objective(family, optimum, X, y, args.alpha)
    header = ["batch", "rows", "eta0", f"epochs to {args.gap:g}", "train seconds to it", "last gap"]
    rows = []
    with threadpool_limits(1):
        torch.set_num_threads(1)
        for preconditioned in (False, True):
            fit_plan.PRECONDITION_SPARSE = preconditioned
            for batch_size in (int(b) for b in args.batch_sizes.split(",")):
                model = CASGDLogisticRegression(
                    alpha=args.alpha, batch_size=batch_size, max_iter=args.epochs, tol=None,
                    random_state=0,
                ).fit(X, y)  # fmt: skip
                gaps = (np.asarray(model.loss_curve_) - best) / best
                reached = np.flatnonzero(gaps <= args.gap)
                epochs = int(reached[0]) + 1 if reached.size else None
                seconds = model.fit_stats_["epoch_seconds"][epochs - 1] if epochs else None
                rows.append(
                    [
                        batch_size,
                        "preconditioned" if preconditioned else "as stored",
                        f"{model.fit_stats_['eta0']:.3g}",
                        "-" if epochs is None else epochs,
                        "-" if seconds is None else f"{seconds:.3f}",
                        f"{gaps[-1]:.1e}",
                    ]
                )
                print("  ".join(str(v) for v in rows[-1]), flush=True)
    print(f"{args.data}: {X.shape[0]} x {X.shape[1]}, alpha={args.alpha}, one thread")
    print_table(header, rows)
    if args.csv:
        write_csv(args.csv, header, rows)


if __name__ == "__main__":
    main()
