"""Fixtures of the server test modules (test_server*.py): a served engine per module, the fake and SmolLM2."""

import pytest
from fake_engine import FakeEngine
from served_app import Served, real_engine


@pytest.fixture(scope="module", params=["fake", "smollm2"])
def served(request):
    engine = FakeEngine(num_blocks=256, step_delay_s=0.005) if request.param == "fake" else real_engine()
    s = Served(engine)
    s.kind = request.param
    yield s
    s.close()


@pytest.fixture(scope="module")
def fake_served():
    s = Served(FakeEngine(num_blocks=256, step_delay_s=0.005))
    yield s
    s.close()
