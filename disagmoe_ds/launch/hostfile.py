"""DeepSpeed hostfiles: validated before launch, with a one-line error instead of the launcher's traceback.

The format is DeepSpeed's (``launcher/runner.py::_parse_hostfile``): one ``HOST slots=N`` per line, ``#``
starts a comment line, blank lines are ignored, a host may appear once. We are a little stricter than
DeepSpeed, which also accepts trailing text after ``slots=N`` (``worker-0 slots=8x`` launches 8 ranks) and
silently falls back to the local machine when the file does not exist. The one trailing field we read is a GPU type,
``HOST slots=N gpu=TYPE`` (DeepSpeed ignores it): on a fleet of two GPU types the disaggregated job's attention ranks
must land on the hosts of its ``cluster`` and the expert ranks on those of its ``ffn_cluster`` (``check_gpu_types``).

>>> parse_hostfile(["# two nodes", "worker-0 slots=8", "", "worker-1 slots=8  # the second"], "hf")
{'worker-0': 8, 'worker-1': 8}
>>> gpu_types(["a slots=8 gpu=h200", "b slots=8 gpu=a100 # older"], "hf")
{'a': 'h200', 'b': 'a100'}
"""

from __future__ import annotations

import json
import re
import shlex
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from disagmoe_ds.errors import ConfigError

_ENTRY = re.compile(r"^(\S+)\s+slots=(\d+)(?:\s+gpu=(\S+))?\s*(#.*)?$")
_FORMAT = "each line must be 'HOST slots=N' (N >= 1) or 'HOST slots=N gpu=TYPE'; '#' starts a comment"
# Launcher flags that pick a subset of the hostfile's slots: the total then is not the world size.
_SLOT_FILTERS = ("-i", "--include", "-e", "--exclude", "--num_nodes", "--num_gpus")


def parse_hostfile(lines: Sequence[str], name: str) -> dict[str, int]:
    """Host -> slots, in file order; a ``ConfigError`` naming the line for anything DeepSpeed would reject."""
    hosts: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _ENTRY.match(line)
        if match is None or int(match.group(2)) < 1:
            raise ConfigError(f"hostfile {name} line {number}: {line!r} is malformed; {_FORMAT}")
        host = match.group(1)
        if host in hosts:
            raise ConfigError(f"hostfile {name} line {number}: host {host!r} is listed twice; list each host once")
        hosts[host] = int(match.group(2))
    if not hosts:
        raise ConfigError(f"hostfile {name} lists no host; {_FORMAT}")
    return hosts


def gpu_types(lines: Sequence[str], name: str) -> dict[str, str]:
    """Host -> GPU type for a hostfile whose hosts carry ``gpu=TYPE`` (lower case); empty where none does, a
    ``ConfigError`` where only some do (``parse_hostfile`` has checked the lines)."""
    entries = [_ENTRY.match(raw.strip()) for raw in lines]
    found = {m.group(1): m.group(3) for m in entries if m is not None}
    typed = {host: gpu.lower() for host, gpu in found.items() if gpu}
    if typed and len(typed) < len(found):
        untyped = ", ".join(host for host in found if host not in typed)
        raise ConfigError(f"hostfile {name}: {untyped} carry no gpu=TYPE where the other hosts do; give every host one")
    return typed


def check_gpu_types(path: Path, hosts: dict[str, int], sides: Sequence[str], clusters: Mapping[str, str]) -> None:
    """Each rank's host has the GPU type its side is priced on: ``sides[rank]`` names the side ("attention" or
    "ffn"), ``clusters`` its cluster (a preset, or a cluster JSON whose ``name`` is the type). The launcher numbers
    ranks host by host in file order; a hostfile without GPU types passes."""
    types = gpu_types(path.read_text().splitlines(), str(path))
    if not types:
        return
    wanted = {side: _type_of(cluster) for side, cluster in clusters.items()}
    start = 0
    for host, slots in hosts.items():
        for side in dict.fromkeys(sides[start : start + slots]):
            if types[host] != wanted[side]:
                key = "cluster" if side == "attention" else "ffn_cluster"
                raise ConfigError(
                    f"hostfile {path}: {host} (gpu={types[host]}) holds ranks {start}-{start + slots - 1}, {side} "
                    f'ranks the job prices on {wanted[side]} ("disagmoe.{key}"); list the {wanted["attention"]} hosts '
                    f'first (the attention ranks come first), or change "disagmoe.{key}"'
                )
        start += slots


def _type_of(cluster: str) -> str:
    """A cluster setting's GPU type: a preset's name, or a cluster JSON's ``name``."""
    if not cluster.endswith(".json"):
        return cluster.lower()
    return str(json.loads(Path(cluster).read_text(encoding="utf-8")).get("name", Path(cluster).stem)).lower()


def check_hostfile(path: Path, *, world_size: int | None = None) -> dict[str, int]:
    """Parse ``path``, check that every host resolves from here and, given the layout's world size, that the slots
    add up to it."""
    if not path.is_file():
        raise ConfigError(f"hostfile {path} does not exist (DeepSpeed would silently use only this machine)")
    hosts = parse_hostfile(path.read_text().splitlines(), str(path))
    for host in hosts:
        _check_resolves(path, host)
    total = sum(hosts.values())
    if world_size is not None and total != world_size:
        raise ConfigError(
            f"hostfile {path} has {total} slots ({describe(hosts)}) but the layout needs {world_size} ranks "
            f"(attention_gpus + ffn_gpus); change the slots or the layout"
        )
    return hosts


def check_node_groups(path: Path, hosts: dict[str, int], groups: Sequence[Sequence[int]]) -> None:
    """Each group of ranks that must share a host (``node_dedup``'s nodes) lies on one host of the file: the
    launcher gives each host's slots consecutive ranks, in file order (``check_hostfile`` has checked that they
    number the world size)."""
    host_of = [host for host, slots in hosts.items() for _ in range(slots)]
    for ranks in groups:
        spanned = sorted({host_of[rank] for rank in ranks})
        if len(spanned) > 1:
            spans, start = [], 0
            for host, slots in hosts.items():
                spans.append(f"{start}-{start + slots - 1} on {host}")
                start += slots
            raise ConfigError(
                f"hostfile {path}: node_dedup {len(ranks)} puts expert ranks {tuple(ranks)} on one node, but they are "
                f"on {', '.join(spanned)} (ranks {', '.join(spans)}); choose a node_dedup whose groups stay on one "
                "host, or change the slots or the layout"
            )


def _check_resolves(path: Path, host: str) -> None:
    """The launcher reaches each host by name (ssh, then the rendezvous): one that does not resolve fails there in a
    long traceback, or, with ``--no_ssh_check``, runs the job on this machine alone."""
    try:
        socket.getaddrinfo(host, None)
    except OSError as error:
        raise ConfigError(
            f"hostfile {path}: host {host!r} does not resolve from this machine ({error.strerror or error}); fix the "
            "name, or make it resolvable here (DNS or /etc/hosts)"
        ) from None


def describe(hosts: dict[str, int]) -> str:
    return ", ".join(f"{host}: {slots}" for host, slots in hosts.items())


def deepspeed_command(hostfile: Path, launcher_args: str, script: str, script_args: Sequence[str]) -> list[str]:
    """``deepspeed --hostfile H [launcher args] script [args]``, the command ``--hostfile`` re-runs under.

    The launcher is started as ``python -m deepspeed.launcher.runner`` (what the ``deepspeed`` script runs) with
    this interpreter, so it works without the virtual environment's ``bin`` on PATH.
    """
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner"]
    return [*launcher, "--hostfile", str(hostfile), *shlex.split(launcher_args), script, *script_args]


def filters_slots(launcher_args: str) -> bool:
    """True when the launcher arguments select a subset of the slots (then their total is not checked)."""
    return any(arg.split("=")[0] in _SLOT_FILTERS for arg in shlex.split(launcher_args))


def strip_launch_flags(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--hostfile X`` and ``--launcher-args X`` (either spelling: separate or with '=').

    >>> strip_launch_flags(["--steps", "5", "--hostfile", "h", "--launcher-args=--no_ssh_check", "--sft"])
    ['--steps', '5', '--sft']
    """
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--hostfile", "--launcher-args"):
            skip = True
        elif not arg.startswith(("--hostfile=", "--launcher-args=")):
            out.append(arg)
    return out
