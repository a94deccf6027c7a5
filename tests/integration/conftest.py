import pytest

from tests.integration.nodes import NodeProc


@pytest.fixture
def nodes(tmp_path):
    """Factory for real node processes; kills whatever a test leaves running."""
    started: list[NodeProc] = []

    def start(name: str, *args: str, env: dict[str, str] | None = None) -> NodeProc:
        return NodeProc(name, tmp_path, list(args), started, env)

    yield start
    for node in started:
        node.kill_all()
