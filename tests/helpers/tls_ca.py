"""The mark that skips a test without `openssl` (the tests' CA is pipeline.tools.hosts.private_ca)."""

from __future__ import annotations

import pytest

from pipeline.tools.hosts.private_ca import OPENSSL

needs_openssl = pytest.mark.skipif(OPENSSL is None, reason="the openssl command is not installed")
