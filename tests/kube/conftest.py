"""The REST API server stand-in for every test here, started and stopped around each."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.kube.rest_fake import RestApiServer


@pytest.fixture
def rest() -> Iterator[RestApiServer]:
    server = RestApiServer().start()
    yield server
    server.stop()


