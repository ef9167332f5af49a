"""trainer/diloco/tcp.py: the one line a region's leader logs about its host's congestion control."""

from __future__ import annotations

from pathlib import Path

from geoshard.trainer.diloco.tcp import congestion_advice


def test_a_host_without_bbr_is_told_what_to_set(tmp_path: Path) -> None:
    cc = tmp_path / "tcp_congestion_control"
    cc.write_text("cubic\n")
    line = congestion_advice(cc)
    assert line is not None
    assert line.startswith("this host's TCP congestion control is cubic (net.ipv4.tcp_congestion_control)")
    assert line.endswith("set net.ipv4.tcp_congestion_control=bbr on the hosts that exchange")
    for quiet in ("bbr\n", "bbr2", "", "cubic; rm -rf /\n", "x" * 40):  # BBR, or nothing that reads as a name
        cc.write_text(quiet)
        assert congestion_advice(cc) is None, quiet
    assert congestion_advice(tmp_path / "absent") is None  # not Linux, or no /proc
