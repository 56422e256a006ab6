"""What the ranks of an emulated cluster run as (no root needed): their hostnames and
/etc/hosts, the interpreter a bare ``python`` becomes, their PATH (#39 item 2).

    .venv/bin/python -m pytest tests/unit/test_emu_names.py -q

The root tests that run these for real are in tests/emu/test_launch.py.
"""

from __future__ import annotations

import os
import sys

from mlfabric.emu.cluster import plan_cluster
from mlfabric.emu.cmd import ns_exec_prefix
from mlfabric.emu.launcher import rank_command, rank_path


def test_hosts_file_names_every_address_both_ways():
    plan = plan_cluster("bcube:n=2,k=2", 1e8, prefix="mfabcd")
    lines = plan.hosts_file().splitlines()
    assert lines[0] == "127.0.0.1\tlocalhost"
    # NIC 0 carries the hostname and the short alias; the other NICs get a name of their own.
    assert "10.0.0.1\tmfabcd-h0 h0" in lines and "10.1.0.4\tmfabcd-h3-eth1" in lines
    # TCPStore's dual-stack listener sees IPv4 clients as ::ffff:a.b.c.d (reverse lookups).
    assert "::ffff:10.0.0.2\tmfabcd-h1" in lines and "::ffff:10.1.0.2\tmfabcd-h1-eth1" in lines
    assert "::ffff:127.0.0.1\tlocalhost" in lines
    # Every host address appears once per family: 4 hosts x 2 NICs, plus localhost.
    assert len(lines) == 2 * (1 + 4 * 2)
    assert [h.hostname for h in plan.hosts] == [f"mfabcd-h{h}" for h in range(4)]
    assert [h.alias for h in plan.hosts] == ["h0", "h1", "h2", "h3"]
    described = plan.describe()["hosts"]
    assert described[2]["hostname"] == "mfabcd-h2" and described[2]["alias"] == "h2"  # type: ignore[index]


def test_ranks_run_under_their_hostname():
    plain = ns_exec_prefix("mfabcd-h1")
    assert plain[1:] == ["netns", "exec", "mfabcd-h1"]
    named = ns_exec_prefix("mfabcd-h1", "mfabcd-h1")
    assert named[:4] == plain and named[4].endswith("unshare") and named[5:8] == ["--uts", "--", "sh"]
    assert named[-1] == "mfabcd-h1"  # $0 of the sh -c script that sets the hostname
    assert [p[-1] for p in plan_cluster("star:n=3", 1e8, prefix="mfabcd").command_prefixes()] == \
        ["mfabcd-h0", "mfabcd-h1", "mfabcd-h2"]


def test_a_bare_python_is_the_launchers_interpreter():
    assert rank_command(("python", "train.py", "--x")) == (sys.executable, "train.py", "--x")
    assert rank_command(("python3", "-c", "pass")) == (sys.executable, "-c", "pass")
    # A path, another interpreter or another program is run as given.
    assert rank_command(("/usr/bin/python3", "t.py")) == ("/usr/bin/python3", "t.py")
    assert rank_command(("torchrun", "--nnodes", "4")) == ("torchrun", "--nnodes", "4")
    assert rank_command(("python2", "t.py")) == ("python2", "t.py")


def test_the_ranks_path_starts_with_the_launchers_environment():
    own = os.path.dirname(sys.executable)
    assert rank_path("/usr/bin:/bin") == f"{own}:/usr/bin:/bin"
    assert rank_path(f"/usr/bin:{own}:/bin") == f"{own}:/usr/bin:/bin"  # moved first, not repeated
    assert rank_path(None).split(":")[0] == own
