"""Every public class, function and method has a valid numpydoc docstring."""

import inspect

import pytest

numpydoc_validate = pytest.importorskip("numpydoc.validate")

import sklearn_casgd  # noqa: E402
from sklearn_casgd import datasets, metrics, plotting  # noqa: E402

# Not required of every docstring: a See Also section (SA01), an extended
# summary (ES01) and examples on methods (EX01). RT02 asks for a bare type
# on single returns; like scikit-learn, the Returns sections name the value
# ("self : object"). GL08 (no docstring) cannot occur for the names listed.
IGNORED = {"SA01", "ES01", "EX01", "RT02"}

PUBLIC = [
    *(getattr(sklearn_casgd, name) for name in sklearn_casgd.__all__),
    datasets.make_glm_data,
    metrics.glm_objective,
    plotting.LossCurveDisplay,
]


def public_names():
    for obj in PUBLIC:
        yield f"{obj.__module__}.{obj.__qualname__}"
        if inspect.isclass(obj):
            for name, member in vars(obj).items():
                if not name.startswith("_") and callable(member):
                    yield f"{obj.__module__}.{obj.__qualname__}.{name}"
            if any(klass.__name__.startswith("_Base") for klass in obj.__mro__):
                for name in ("fit", "predict", "score"):
                    if hasattr(obj, name) and name not in vars(obj):
                        owner = next(k for k in obj.__mro__ if name in vars(k))
                        if owner.__module__.startswith("sklearn_casgd"):
                            yield f"{owner.__module__}.{owner.__qualname__}.{name}"


@pytest.mark.parametrize("name", sorted(set(public_names())))
def test_docstring_is_valid_numpydoc(name):
    result = numpydoc_validate.validate(name)
    errors = [(code, message) for code, message in result["errors"] if code not in IGNORED]
    assert not errors, "\n".join(f"{code}: {message}" for code, message in errors)
