"""Hostfiles are checked before launch: DeepSpeed's format, each host once and resolvable, slots adding up to the
layout."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from disagmoe_ds.errors import ConfigError
from disagmoe_ds.launch.hostfile import (
    check_hostfile,
    deepspeed_command,
    filters_slots,
    parse_hostfile,
    strip_launch_flags,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["localhost-cpu", "1node-8gpu", "2nodes-16gpu"])
def test_shipped_hostfiles_parse(name: str, monkeypatch) -> None:
    if name != "localhost-cpu":  # cluster hostfiles: their workers resolve on the cluster, not here
        monkeypatch.setattr(socket, "getaddrinfo", lambda host, port: [(None, None, None, "", ("10.0.0.1", 0))])
    hosts = check_hostfile(ROOT / "hostfiles" / name)
    assert hosts and all(slots >= 1 for slots in hosts.values())


def test_comments_blank_lines_and_trailing_comments() -> None:
    lines = ["# cluster", "", "   ", "node-a slots=4", "node-b\tslots=2   # half a node"]
    assert parse_hostfile(lines, "h") == {"node-a": 4, "node-b": 2}


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (["node-a slots=two"], r"line 1: 'node-a slots=two' is malformed"),
        (["node-a 8"], r"line 1: 'node-a 8' is malformed"),
        (["# c", "node-a slots=8x"], r"line 2: 'node-a slots=8x' is malformed"),  # DeepSpeed would launch 8
        (["node-a slots=0"], r"line 1: 'node-a slots=0' is malformed; each line must be 'HOST slots=N' \(N >= 1\)"),
        (["node-a slots=8", "node-a slots=8"], r"line 2: host 'node-a' is listed twice"),
        (["# only a comment", ""], r"lists no host"),
    ],
)
def test_malformed_hostfiles_are_one_line_errors(lines: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        parse_hostfile(lines, "hf")
    assert "\n" not in str(info.value)


def test_missing_file_and_world_size(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        check_hostfile(tmp_path / "nope")
    hf = tmp_path / "hf"
    hf.write_text("localhost slots=8\n127.0.0.1 slots=8\n")
    assert check_hostfile(hf, world_size=16) == {"localhost": 8, "127.0.0.1": 8}
    with pytest.raises(ConfigError, match=r"has 16 slots \(localhost: 8, 127.0.0.1: 8\) but the layout needs 4"):
        check_hostfile(hf, world_size=4)


def test_a_host_that_does_not_resolve_is_refused(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.write_text("localhost slots=2\nno-such-host.invalid slots=2\n")  # .invalid never resolves (RFC 2606)
    with pytest.raises(ConfigError, match=r"host 'no-such-host.invalid' does not resolve from this machine") as info:
        check_hostfile(hf, world_size=4)
    assert "\n" not in str(info.value)


def test_relaunch_command() -> None:
    argv = ["--steps", "5", "--hostfile", "hf", "--launcher-args", "--no_ssh_check --master_addr 127.0.0.1"]
    command = deepspeed_command(Path("hf"), argv[-1], "run_pretrain.py", strip_launch_flags(argv))
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner"]
    assert command == [*launcher, "--hostfile", "hf", "--no_ssh_check", "--master_addr", "127.0.0.1",
                       "run_pretrain.py", "--steps", "5"]  # fmt: skip
    assert filters_slots("--include worker-0:0,1") and filters_slots("--num_gpus=2") and not filters_slots("")


def test_expert_ranks_that_share_a_message_must_share_a_host() -> None:
    """``node_dedup``'s groups against the hosts' consecutive ranks: one line naming the group and the hosts."""
    from disagmoe_ds.launch.hostfile import check_node_groups

    check_node_groups(Path("hf"), {"a": 4, "b": 4}, [(2, 3), (4, 5)])  # ranks 0-3 on a, 4-7 on b
    with pytest.raises(ConfigError, match=r"node_dedup 2 puts expert ranks \(2, 3\) on one node, but they are on a, b"):
        check_node_groups(Path("hf"), {"a": 3, "b": 5}, [(2, 3), (4, 5)])


def test_gpu_types_are_read_for_every_host_or_none() -> None:
    from disagmoe_ds.launch.hostfile import gpu_types

    lines = ["a slots=8 gpu=H200", "b slots=8 gpu=a100  # older"]
    assert parse_hostfile(lines, "hf") == {"a": 8, "b": 8}
    assert gpu_types(lines, "hf") == {"a": "h200", "b": "a100"}
    assert gpu_types(["a slots=8", "b slots=8"], "hf") == {}
    with pytest.raises(ConfigError, match="hostfile hf: b carry no gpu=TYPE where the other hosts do"):
        gpu_types(["a slots=8 gpu=h200", "b slots=8"], "hf")
    with pytest.raises(ConfigError, match="is malformed"):
        parse_hostfile(["a slots=8 gpu="], "hf")


def test_each_side_lands_on_its_gpu_type(tmp_path: Path, monkeypatch, capsys) -> None:
    """run_pretrain.py's hostfile check on a fleet of two GPU types: the ds_config prices the attention side on
    ``cluster`` and the experts on ``ffn_cluster``; a hostfile listing the expert type first is one line, before
    launch."""
    import json

    import run_pretrain

    config = json.loads((ROOT / "ds_configs" / "2node-16gpu-bf16.json").read_text())
    config["disagmoe"] |= {"cluster": "h200", "ffn_cluster": "a100"}
    ds = tmp_path / "fleet.json"
    ds.write_text(json.dumps(config))
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, port: [(None, None, None, "", ("10.0.0.1", 0))])
    good, swapped = tmp_path / "good", tmp_path / "swapped"
    good.write_text("worker-0 slots=8 gpu=h200\nworker-1 slots=8 gpu=a100\n")
    swapped.write_text("worker-1 slots=8 gpu=a100\nworker-0 slots=8 gpu=h200\n")
    assert run_pretrain.main(["--check-hostfile", str(good), "--deepspeed_config", str(ds)]) == 0
    assert run_pretrain.main(["--check-hostfile", str(swapped), "--deepspeed_config", str(ds)]) == 2
    assert capsys.readouterr().err == (
        f"run_pretrain.py: error: hostfile {swapped}: worker-1 (gpu=a100) holds ranks 0-7, attention ranks the job "
        'prices on h200 ("disagmoe.cluster"); list the h200 hosts first (the attention ranks come first), or change '
        '"disagmoe.cluster"\n'
    )
