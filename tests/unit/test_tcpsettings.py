"""The start-up check of the host's TCP settings against a long, fast link."""

import pytest

from p2p.tcpsettings import ADVISED, ADVISED_MAX, PLAN_RATE, PLAN_RTT, TcpSettings

pytestmark = pytest.mark.timeout(10)


def settings(tmp_path, send: str, receive: str, idle: str = "0", congestion: str = "bbr") -> TcpSettings | None:
    (tmp_path / "tcp_wmem").write_text(send)
    (tmp_path / "tcp_rmem").write_text(receive)
    (tmp_path / "tcp_slow_start_after_idle").write_text(idle)
    (tmp_path / "tcp_congestion_control").write_text(congestion + "\n")
    return TcpSettings.read(tmp_path)


def test_linux_stock_settings_are_named_with_the_command_that_fixes_them(tmp_path):
    stock = settings(tmp_path, "4096\t16384\t4194304\n", "4096\t131072\t6291456\n", "1\n", "cubic")
    assert stock == TcpSettings(4194304, 6291456, True, "cubic")
    # The smaller of the two limits, half of it in flight per round trip: 4 MiB at 250 ms.
    assert stock.cap(0.25) == pytest.approx(4194304 * 0.5 * 8 / 0.25)
    buffers, idle, congestion = stock.warnings()
    assert "67 Mbit/s at 250 ms" in buffers and "tcp_wmem max 4.0 MiB" in buffers
    assert f"net.ipv4.tcp_wmem='4096 16384 {ADVISED_MAX}'" in buffers
    assert "sysctl -w net.ipv4.tcp_slow_start_after_idle=0" in idle
    assert "is cubic" in congestion and "sysctl -w net.ipv4.tcp_congestion_control=bbr" in congestion


def test_the_advised_settings_fill_the_planned_link_and_say_nothing(tmp_path):
    advised = settings(tmp_path, f"4096 16384 {ADVISED_MAX}", f"4096 131072 {ADVISED_MAX}")
    assert advised.cap(PLAN_RTT) >= PLAN_RATE and advised.warnings() == []
    # A receive limit below the send limit caps the connection just the same.
    assert len(settings(tmp_path, f"4096 16384 {ADVISED_MAX}", "4096 131072 4194304").warnings()) == 1


def test_the_wan_testbed_raises_exactly_what_the_node_advises():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import wanlink

    assert wanlink.TCP_BUFFERS["raised"] == ADVISED
    assert wanlink.TCP_BUFFERS["stock"].keys() == ADVISED.keys()


def test_unreadable_settings_are_no_answer(tmp_path):
    assert TcpSettings.read(tmp_path / "missing") is None
    assert settings(tmp_path, "garbage", "4096 1") is None
