"""model.host_memory: "retain" keeps freed host blocks in the process, so a repeated large temporary
(what every frame pair and every compression allocates) stops page-faulting. Measured in a fresh
interpreter, because the setting is per process and the baseline needs glibc's defaults."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from edgekv.config import ConfigError, EdgeKVConfig
from edgekv.hostmem import configure_host_memory

GLIBC = platform.libc_ver()[0] == "glibc"

PROBE = r"""
import resource, sys, torch
from edgekv.hostmem import configure_host_memory

said = configure_host_memory(sys.argv[1])
faults = []
for _ in range(12):  # what a stream does: the same large temporaries, allocated and freed again and again
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    big = torch.empty(48 << 18, dtype=torch.float32).fill_(1.0)  # 48 MiB: above glibc's default mmap limit
    small = torch.empty(16 << 18, dtype=torch.float32).fill_(2.0)
    del big, small
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(",".join(map(str, faults)), said, sep="|")
"""
PAGES = (64 << 20) // 4096  # pages of one repetition's two temporaries


def probe(mode: str) -> tuple[list[int], str]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120, check=True)
    faults, said = out.stdout.strip().splitlines()[-1].split("|")
    return [int(x) for x in faults.split(",")], said


@pytest.mark.skipif(not GLIBC, reason="host_memory: retain acts through glibc's mallopt; this C library is not glibc")
def test_retain_stops_page_faults_of_repeated_temporaries():
    faults, said = probe("retain")
    assert said.startswith("retain (glibc")
    # glibc's aligned allocations fragment the first few freed blocks; after that they are reused
    assert sum(faults[-4:]) < PAGES // 50, f"retained blocks should be reused: faults per repetition {faults}"


@pytest.mark.skipif(not GLIBC, reason="host_memory acts through glibc's mallopt; this C library is not glibc")
def test_release_keeps_the_defaults():
    faults, said = probe("release")
    assert said.startswith("release")
    assert min(faults[-4:]) > PAGES // 2, f"glibc's defaults map each large block afresh: {faults}"


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="model.host_memory: expected 'retain' or 'release', got 'keep'"):
        configure_host_memory("keep")
    with pytest.raises(ConfigError, match="host_memory"):
        EdgeKVConfig().with_overrides(model={"host_memory": "keep"})
