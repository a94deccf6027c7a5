"""The start-up check of the host's TCP buffer limits against a long, fast link."""

import pytest

from p2p.tcpbuffers import ADVISED_MAX, PLAN_RATE, PLAN_RTT, TcpBuffers

pytestmark = pytest.mark.timeout(10)


def limits(tmp_path, send: str, receive: str) -> TcpBuffers | None:
    (tmp_path / "tcp_wmem").write_text(send)
    (tmp_path / "tcp_rmem").write_text(receive)
    return TcpBuffers.read(tmp_path)


def test_linux_stock_limits_are_named_with_the_command_that_lifts_them(tmp_path):
    stock = limits(tmp_path, "4096\t16384\t4194304\n", "4096\t131072\t6291456\n")
    assert stock == TcpBuffers(4194304, 6291456)
    # The smaller of the two limits, half of it in flight per round trip: 4 MiB at 250 ms.
    assert stock.cap(0.25) == pytest.approx(4194304 * 0.5 * 8 / 0.25)
    warning = stock.warning()
    assert "67 Mbit/s at 250 ms" in warning and "tcp_wmem max 4.0 MiB" in warning
    assert f"net.ipv4.tcp_wmem='4096 16384 {ADVISED_MAX}'" in warning


def test_the_advised_limits_fill_the_planned_link_and_say_nothing(tmp_path):
    advised = limits(tmp_path, f"4096 16384 {ADVISED_MAX}", f"4096 131072 {ADVISED_MAX}")
    assert advised.cap(PLAN_RTT) >= PLAN_RATE and advised.warning() is None
    # A receive limit below the send limit caps the connection just the same.
    assert limits(tmp_path, f"4096 16384 {ADVISED_MAX}", "4096 131072 4194304").warning() is not None


def test_unreadable_limits_are_no_answer(tmp_path):
    assert TcpBuffers.read(tmp_path / "missing") is None
    assert limits(tmp_path, "garbage", "4096 1") is None
