"""Time as people live it: wall times on the days the clocks change (a time they skipped, a time they showed twice),
in zones with 30- and 45-minute offsets, and a device whose zone changes while the daemon runs. Each test sets its
zone (TZ) and puts the machine's back after it; none depends on the zone of the machine it runs on."""

from __future__ import annotations

import datetime as dt
import os
import time

import pytest

from edgekv.apps.wall_times import WindowError, forget_request, parse_wall_time, wall_text, window_bounds


def _local(text: str, fold: int = 0) -> float:
    """``text`` (naive ISO 8601) as this zone's clock showed it (``fold=1``: the second time)."""
    return dt.datetime.fromisoformat(text).replace(fold=fold).timestamp()


def test_a_time_the_clocks_skipped_is_refused_not_read_an_hour_later(zone):
    """Berlin, 2026-03-29: 02:00 became 03:00. "02:30" was read as 03:30 (a window "02:15 to 02:45" forgot 03:15 to
    03:45, which no one named), and at 03:10 as yesterday's 02:30; both are now refused, saying why."""
    zone("Europe/Berlin")
    morning = _local("2026-03-29T05:00")
    with pytest.raises(ValueError, match=r"'02:30': the clocks here skipped 02:30 on 2026-03-29 \(set forward 60 "):
        parse_wall_time("02:30", now=morning)
    with pytest.raises(ValueError, match="from: '02:15': the clocks here skipped"):
        window_bounds("02:15", "02:45", now=morning, forget=True)
    with pytest.raises(ValueError, match="to: '02:30': the clocks here skipped"):
        window_bounds("01:50", "02:30", now=morning, forget=True)
    with pytest.raises(ValueError, match="skipped 02:30 on 2026-03-29"):
        parse_wall_time("2026-03-29T02:30")  # an ISO date and time without an offset is local time too
    with pytest.raises(ValueError, match="skipped 02:30 on 2026-03-29"):
        parse_wall_time("02:30", now=_local("2026-03-29T03:10"))  # meant today's, not yesterday's
    # a window across the change is the 20 minutes it was; before the change "02:30" is still yesterday's
    assert window_bounds("01:50", "03:10", now=morning, forget=True)[1:] == (_local("2026-03-29T01:50"),
                                                                             _local("2026-03-29T03:10"))
    assert parse_wall_time("02:30", now=_local("2026-03-29T01:30")) == _local("2026-03-28T02:30")
    zone("Australia/Lord_Howe")  # half an hour: 02:00 became 02:30 on 2026-10-04
    with pytest.raises(ValueError, match=r"skipped 02:15 on 2026-10-04 \(set forward 30 minutes\)"):
        parse_wall_time("02:15", now=_local("2026-10-04T05:00"))
    assert parse_wall_time("02:30", now=_local("2026-10-04T05:00")) == _local("2026-10-04T02:30")


def test_a_time_the_clocks_showed_twice_is_refused_naming_both(zone):
    """New York, 2026-11-01: 02:00 became 01:00, so 01:30 came twice. It was read silently as the first: "forget
    01:15 to 01:45" asked in the second half hour's wake forgot the first, and a question by it said nothing was
    seen. Now it is refused with both readings; given with its offset it is one moment."""
    zone("America/New_York")
    morning = _local("2026-11-01T05:00")
    with pytest.raises(ValueError, match=r"'01:30': the clocks here showed 2026-11-01 01:30 twice \(set back\): say "
                                         r"which, with its UTC offset: 2026-11-01T01:30:00-04:00 \(the first time\) "
                                         r"or 2026-11-01T01:30:00-05:00 \(the second\)"):
        parse_wall_time("01:30", now=morning)
    for t_from, t_to, wrong in (("01:15", "01:45", "from"), ("00:30", "01:30", "to")):
        with pytest.raises(ValueError, match=f"{wrong}: '01:[13][05]': the clocks here showed"):
            window_bounds(t_from, t_to, now=morning, forget=True)
    with pytest.raises(WindowError, match="showed 2026-11-01 01:30 twice") as refused:
        forget_request({"from": "2026-11-01T01:30", "to": "2026-11-01T01:45:00-05:00"})
    assert refused.value.param == "from"
    second = _local("2026-11-01T01:30", fold=1)
    assert forget_request({"from": "2026-11-01T01:30-05:00", "to": "2026-11-01T01:45-05:00"}) == {
        "unix": (second, second + 900)}
    # where only one of the two has come yet, that one is meant
    assert parse_wall_time("01:30", now=_local("2026-11-01T01:40")) == _local("2026-11-01T01:30")
    assert parse_wall_time("01:50", now=_local("2026-11-01T01:40", fold=1)) == _local("2026-11-01T01:50")
    assert window_bounds("2026-11-01T01:40-05:00", "01:50", now=morning)[2] == _local("2026-11-01T01:50", fold=1)
    zone("Pacific/Chatham")  # +13:45 became +12:45 on 2026-04-05: 02:45 to 03:45 came twice
    with pytest.raises(ValueError, match=r"03:00:00\+13:45 \(the first time\) or 2026-04-05T03:00:00\+12:45"):
        parse_wall_time("03:00", now=_local("2026-04-05T06:00"))
    assert window_bounds("23:50", "00:10", now=_local("2026-04-05T00:05"), forget=True)[1:] == (
        _local("2026-04-04T23:50"), _local("2026-04-05T00:10"))


def test_a_time_printed_in_the_hour_that_came_twice_carries_its_offset(zone):
    """"seen 2026-11-01 01:30:05" named either 01:30:05; a time of that hour is printed with its UTC offset."""
    zone("America/New_York")
    assert wall_text(_local("2026-11-01T01:30:05")) == "2026-11-01 01:30:05-0400"
    assert wall_text(_local("2026-11-01T01:30:05", fold=1)) == "2026-11-01 01:30:05-0500"
    assert wall_text(_local("2026-11-01T02:30:05")) == "2026-11-01 02:30:05"  # once only: as before
    # a forget's "nothing seen" note for "the last 10**9 s" starts in a year a datetime cannot hold: still printed
    assert wall_text(-2.0 ** 42).startswith("-137399-") and wall_text(2.0 ** 42).startswith("141338-")


def test_a_daemon_follows_the_zone_the_device_moved_to(zone):
    """The wearer flew from Berlin to New York and the device's zone changed under the running daemon (TZ here;
    systemd-timedated's /etc/localtime behaves the same): it read "03:00" and printed times in Berlin's zone until
    restarted, since C reads the zone once per process."""
    from edgekv.apps.questions import evidence_item
    from edgekv.session.wallclock import describe_unix

    unix = 1_800_000_000.0  # 2027-01-15T08:00:00Z

    def moved() -> None:  # this process read Berlin's zone; then the device's zone changed, and it was not told
        zone("Europe/Berlin")
        assert time.strftime("%z", time.localtime(unix)) == "+0100"
        os.environ["TZ"] = "America/New_York"

    moved()
    assert describe_unix(unix) == "2027-01-15 03:00:00-0500"
    moved()
    assert wall_text(unix) == "2027-01-15 03:00:00"
    moved()
    assert parse_wall_time("2027-01-15 03:00") == unix
    moved()
    assert evidence_item(1, 2.0, unix)["seen"] == "2027-01-15T03:00:00.000-05:00"
