import os

import pytest


@pytest.fixture(autouse=True)
def _restore_environ():
    """Lightning's launchers leave MASTER_PORT, LOCAL_RANK, NODE_RANK... in the test process;
    a later Trainer would take them for an external launcher's."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
