import pytest

from tests.sampling.tiny import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()
