"""Every connector test taking `connector_type` (or `model`) runs once per connector."""

import pytest

from vlmkit.configuration import CONNECTOR_TYPES

from .connector_testing import build_model


@pytest.fixture(params=CONNECTOR_TYPES)
def connector_type(request) -> str:
    return request.param


@pytest.fixture
def model(connector_type):
    return build_model(connector_type)
