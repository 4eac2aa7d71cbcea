"""README's first hour, run as a newcomer types it (2026-12-06): "The first hour" section's commands against the demo
daemon, and the fleet example's printed answers against what the shipped toy answers on those streams.

The README had no step from the one-shot demo to the daemon and its API (how to start it, what to ask it with, how to
pause, forget, check and plan), and the fleet example printed evidence pairs (12, 11, 16) the shipped toy no longer
gives (13, 12, 15) without saying how its three devices were started. Each command line of the section's second
block is run here, in order, against the demo daemon; a line this file does not know fails the test, so a changed
README is run too.
"""

from __future__ import annotations

import json
import re
import shlex
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_URL = "http://127.0.0.1:8080"


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def _blocks(section: str, kind: str = "bash") -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", section, flags=re.S)


def _demo_config(**video):
    from edgekv.config import load_config

    config = load_config(ROOT / "configs" / "cpu-demo.yaml")
    return config.with_overrides(server={"port": 0}, monitor={"backend": "cpu"}, video=video)


def _curl(argv: list[str], base: str) -> tuple[int, dict]:
    """The README's `curl -s [-X M] [-H H]... [-d D] URL`, sent with urllib to the test's daemon."""
    method, headers, data, url = "GET", {}, None, None
    words = iter(argv[1:])
    for word in words:
        if word == "-s":
            continue
        if word == "-X":
            method = next(words)
        elif word == "-H":
            name, value = next(words).split(":", 1)
            headers[name.strip()] = value.strip()
        elif word == "-d":
            data = next(words).encode()
        elif word.startswith("http"):
            url = word.replace(README_URL, base)
        else:
            raise AssertionError(f"a curl option this test does not know: {word!r}")
    assert url is not None and url.startswith(base), argv
    with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers, method=method),
                                timeout=60) as reply:
        return reply.status, json.loads(reply.read())


@pytest.mark.slow
def test_the_first_hour_commands_do_what_the_readme_says(tmp_path, monkeypatch, capsys):
    pytest.importorskip("fastapi")
    from helpers_server import ended_daemon

    from edgekv.apps.cli import main as edgekv_main
    from edgekv.apps.daemon.camera import main as camera_main

    start, commands = _blocks(_section("The first hour"))
    assert shlex.split(start) == [".venv/bin/edgekv-camera", "--config", "configs/cpu-demo.yaml", "--realtime",
                                  "--no-stdin"]
    lines = [shlex.split(line, comments=True) for line in commands.splitlines()]
    lines = [argv for argv in lines if argv]
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("EDGEKV_TOKEN", raising=False)
    seen = []
    with ended_daemon(_demo_config(), tmp_path / "out.txt") as daemon:  # the demo stream read whole
        base = f"http://127.0.0.1:{daemon.server.port}"
        for argv in lines:
            program, rest = Path(argv[0]).name, argv[1:]
            capsys.readouterr()
            if program == "curl":
                status, body = _curl(argv, base)
                assert status == 200, (argv, body)
                if rest[-1].endswith("/healthz"):
                    assert body["status"] == "ok" and body["stream_state"] == "ended"
                    seen.append("healthz")
                else:
                    switch = rest[-1].rsplit("/", 1)[-1]
                    assert body["paused"] is (switch == "pause"), (switch, body)
                    seen.append(switch)
            elif program == "edgekv" and rest[0] in ("ask", "forget"):
                assert edgekv_main([*rest, "--url", base]) == 0, argv
                out = capsys.readouterr().out
                if "--evidence" in rest:
                    assert out.splitlines()[0] == "triangle", out  # the scene's purple shape
                    assert "evidence:" in out and "frame pair 60" in out, out  # its pair, at 60 s
                    seen.append("ask --evidence")
                elif "--last" in rest and rest[0] == "ask":
                    assert out.strip() == "yes", out  # the purple triangle of 60 s is in the last 30 s
                    seen.append("ask --last")
                else:
                    assert out.startswith("forgot t=") and "frame pair(s) from the cache" in out, out
                    seen.append("forget")
            elif program == "edgekv-camera":
                assert "--check" in rest, argv
                assert camera_main([*rest, "--port", "0"]) == 0, argv  # 8080 may be another process's here
                assert "every check passed: the daemon would start" in capsys.readouterr().out
                seen.append("check")
            elif program == "edgekv" and rest[0] == "plan":
                assert edgekv_main(rest) == 0, argv
                assert "configs/cpu-demo.yaml: cache.max_tokens 640 fits" in capsys.readouterr().out
                seen.append("plan")
            else:
                raise AssertionError(f"a README line this test does not run: {argv}")
    assert seen == ["healthz", "ask --evidence", "ask --last", "forget", "pause", "resume", "check", "plan"]


@pytest.mark.slow
def test_the_fleet_example_prints_what_the_shipped_toy_answers(tmp_path):
    """Each device of the README's fleet example is the demo config on its own stream: asked as the fleet asks (one
    evidence pair), the shipped toy gives the printed colour and evidence pair. The device lines are the ones the
    README's loop starts (device id, seed)."""
    pytest.importorskip("fastapi")
    from helpers_server import chat, ended_daemon

    section = _section("The fleet over MQTT")
    script = next(block for block in _blocks(section) if "mosquitto -p" in block)
    devices = dict(pair.split(":") for pair in re.search(r"for cam in ([^;]+);", script).group(1).split())
    template = re.search(r'--source "([^"]+)"', script).group(1)
    output = re.search(r"```\n(Q: What color was the circle\?\n.*?)```", section, flags=re.S).group(1)
    printed = re.findall(r"^  cam-(\w+) \((synthetic:[^)]+)\): (\w+)\s+\[evidence t=([\d.]+) s \(pair (\d+)\)",
                         output, flags=re.M)
    assert sorted(name for name, *_ in printed) == sorted(devices), output
    for name, source, colour, seconds, pair in printed:
        assert source == template.replace("${cam#*:}", devices[name]), (name, source)
        with ended_daemon(_demo_config(source=source), tmp_path / f"{name}.txt") as daemon:
            status, _, body = chat(daemon.server.port, "What color was the circle?", evidence=1)
        assert status == 200, body
        answer = json.loads(body)
        assert answer["choices"][0]["message"]["content"] == colour, (name, answer)
        evidence = answer["edgekv"]["evidence"][0]
        assert (evidence["pair"], evidence["t"]) == (int(pair), float(seconds)), (name, evidence)
