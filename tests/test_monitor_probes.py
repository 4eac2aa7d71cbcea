"""Probes of the systemd boundary as a deployment meets it: $NOTIFY_SOCKET pointing nowhere, $WATCHDOG_USEC that is
not a number of microseconds. Each case is an environment a unit file or an operator can produce."""

from __future__ import annotations

import logging
import os

import pytest

from edgekv.apps.daemon.systemd import notify_systemd, watchdog_period_s


@pytest.mark.parametrize("usec", ["²", "³0000000", "30000000²", "3e7", " 30000000", "-1", "0", ""])
def test_a_watchdog_usec_that_is_not_ascii_digits_means_no_watchdog_not_a_crash(usec):
    assert watchdog_period_s({"WATCHDOG_USEC": usec}) is None


def test_a_watchdog_pid_that_is_not_ascii_digits_is_not_this_process():
    assert watchdog_period_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "²"}) is None
    assert watchdog_period_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}) == 30.0


@pytest.mark.parametrize("where", ["/nonexistent/edgekv-notify", "@edgekv-probe-nobody-listens"])
def test_a_notify_socket_nobody_listens_on_is_named_in_the_warning(where, monkeypatch, caplog):
    monkeypatch.setenv("NOTIFY_SOCKET", where)
    with caplog.at_level(logging.WARNING, logger="edgekv.systemd"):
        assert notify_systemd("READY=1") is False
    assert where in caplog.text and "READY" in caplog.text
