"""The load errors are a leaf: importing them runs no jax/flax/transformers and no model code."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_errors_import_is_light():
    code = (
        "import sys, jaxlm.model_loader.errors; "
        "heavy = [m for m in ('jax', 'flax', 'transformers', 'jaxlm.models', 'jaxlm.model_loader.loader') "
        "if m in sys.modules]; "
        "assert not heavy, f'importing the load errors pulled in {heavy}'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_package_names_resolve_lazily():
    import jaxlm.model_loader as ml
    from jaxlm.model_loader.errors import WeightShapeError
    from jaxlm.model_loader.loader import get_model

    assert ml.WeightShapeError is WeightShapeError
    assert ml.get_model is get_model
    assert set(ml.__all__) <= set(dir(ml))


def test_unknown_name_is_an_attribute_error():
    import jaxlm.model_loader as ml

    with pytest.raises(AttributeError, match="no_such_thing"):
        ml.no_such_thing  # noqa: B018
