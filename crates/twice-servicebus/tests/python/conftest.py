"""Shared fixtures: the server's connection string and a way to move its clock."""

import os
import urllib.request

import pytest
from azure.servicebus import ServiceBusClient


@pytest.fixture
def conn_str():
    return os.environ["SB_CONNECTION_STRING"]


@pytest.fixture
def client(conn_str):
    # No retries: a refused operation fails at once instead of after the SDK's back-off.
    with ServiceBusClient.from_connection_string(conn_str, retry_total=0) as c:
        yield c


@pytest.fixture
def advance():
    """Moves the server's clock forward by `ms` milliseconds (lock and TTL expiry)."""

    def _advance(ms):
        with urllib.request.urlopen(f"{os.environ['SB_CLOCK']}/advance?ms={int(ms)}") as r:
            assert r.read() == b"ok"

    return _advance
