"""SIGKILL to a node leaves no child behind: its p2pd dies with it. (SIGTERM stopping a node
cleanly with its p2pd, and p2pd's flags: tests/integration/test_operator.py.)"""

import signal

import pytest

from tests.integration.nodes import alive, wait_until
from tests.integration.test_operator import p2pd_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_sigkill_leaves_no_child_behind(nodes):
    node = nodes("kill", "--inner-steps", "1000")
    node.address()
    p2pd = p2pd_of(node)
    node.proc.send_signal(signal.SIGKILL)
    node.wait_exit(30)
    wait_until(lambda: not alive(p2pd), 10, "p2pd to die with its node")
