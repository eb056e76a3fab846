"""Run by the Triton tests: kernels that cannot launch, and the fits that go on.

The kernel module is imported before ``TRITON_INTERPRET`` is set, so Triton
makes it a compiled kernel, which has no driver to run on here; with the
variable set afterwards the library counts the kernel as available on the
CPU. Prints each fit's warnings and its gap to the torch steps' fit as JSON:
the fused row steps', the epoch kernel's and the fused pass's.
"""

import json
import os
import warnings

import numpy as np

from sklearn_casgd._accel import triton_kernel  # noqa: F401 - decorated without the interpreter

os.environ["TRITON_INTERPRET"] = "1"

from sklearn_casgd import CASGDLogisticRegression
from sklearn_casgd._engine import execution
from sklearn_casgd.datasets import make_glm_data

X, y, _ = make_glm_data("logistic", 203, 6, random_state=0)
params = dict(s=4, batch_size=16, precision="fp64", max_iter=3, tol=None, random_state=0)
torch_fit = CASGDLogisticRegression(**params).fit(X, y)
results = {}
names = {id(execution.FUSED_ROW_STEPS): "fused", id(execution.EPOCH_KERNEL): "epoch"}
names[id(execution.FUSED_PASS)] = "pass"
for switch in (execution.FUSED_ROW_STEPS, execution.EPOCH_KERNEL, execution.FUSED_PASS):
    switch["cpu"] = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fallback_fit = CASGDLogisticRegression(**params).fit(X, y)
    switch["cpu"] = False
    results[names[id(switch)]] = {
        "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
        "coef": float(np.abs(fallback_fit.coef_ - torch_fit.coef_).max()),
    }
print(json.dumps(results))
