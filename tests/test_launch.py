"""Local launcher: results in rank order, fail fast on a raise or a dead rank, a hard timeout on a hang."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from disagmoe_ds.errors import ConfigError
from disagmoe_ds.launch import RankFailedError, detect_launcher, spawn_local

# Upper bound for "fail fast": forking 2-3 ranks and one failure report take ~1-2 s on 2 cores; the jobs below
# would otherwise run until their 60 s timeout.
FAST_S = 15.0


def _rank_info(rank: int, scale: float) -> tuple[int, int, str | None, list[float], torch.Tensor]:
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    env = (int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]))
    assert env == (rank, dist.get_world_size())
    return rank, dist.get_rank(), detect_launcher(), total.tolist(), torch.full((2,), rank * scale)


def test_results_come_back_in_rank_order() -> None:
    results = spawn_local(_rank_info, 3, args=(0.5,))
    assert [r[:4] for r in results] == [(rank, rank, "env", [3.0]) for rank in range(3)]
    # Tensors survive the child's exit: results are plain pickles, not shared-memory handles.
    assert [r[4].tolist() for r in results] == [[0.0, 0.0], [0.5, 0.5], [1.0, 1.0]]


_SET_IN_THE_PARENT = False  # a forked rank sees the parent's value, a spawned one imports this module afresh


def _inherits_the_parent(rank: int) -> bool:
    return _SET_IN_THE_PARENT


def test_ranks_are_spawned_where_this_process_initialised_cuda(monkeypatch) -> None:
    """A forked child cannot use CUDA once its parent initialised it (an import of torchao does, through
    transformers): the ranks then start with ``spawn``, and the job runs the same."""
    monkeypatch.setattr(sys.modules[__name__], "_SET_IN_THE_PARENT", True)
    assert spawn_local(_inherits_the_parent, 2) == [True, True]  # forked
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert spawn_local(_inherits_the_parent, 2, timeout_s=120) == [False, False]  # spawned
    results = spawn_local(_rank_info, 2, args=(0.5,), timeout_s=120)
    assert [r[:4] for r in results] == [(rank, rank, "env", [1.0]) for rank in range(2)]


def _raise_in_rank_1(rank: int) -> int:
    if rank == 1:
        raise KeyError("boom in rank 1")
    dist.barrier()  # rank 0 would wait here forever; the parent must kill it
    return rank


@pytest.mark.serial
def test_exception_surfaces_with_traceback_fast() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1 raised") as info:
        spawn_local(_raise_in_rank_1, 2, timeout_s=60.0)
    assert time.monotonic() - start < FAST_S
    assert info.value.rank == 1
    assert "boom in rank 1" in str(info.value) and "_raise_in_rank_1" in str(info.value)
    assert info.value.cause == "KeyError: 'boom in rank 1'"  # the root cause in one line (run_pretrain prints it)


def _hang_in_rank_0(rank: int) -> int:
    if rank == 0:
        time.sleep(600)
    return rank


@pytest.mark.serial
def test_hang_ends_with_timeout_naming_the_rank() -> None:
    timeout_s = 4.0
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0\] were still running") as info:
        spawn_local(_hang_in_rank_0, 2, timeout_s=timeout_s)
    # The deadline plus the stack dump (0.3 s) and the kill.
    assert time.monotonic() - start < timeout_s + 3.0
    assert "stack of rank 0" in str(info.value) and "_hang_in_rank_0" in str(info.value)


def _exit_in_rank_2(rank: int) -> int:
    if rank == 2:
        os._exit(7)
    dist.barrier()
    return rank


@pytest.mark.serial
def test_dead_rank_fails_fast() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 2 exited with code 7 before returning") as info:
        spawn_local(_exit_in_rank_2, 3, timeout_s=60.0)
    assert time.monotonic() - start < FAST_S
    assert info.value.rank == 2
    assert info.value.cause == "exited with code 7 before returning a result"


def test_detect_launcher() -> None:
    assert detect_launcher({}) is None
    ranks = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    assert detect_launcher(ranks) == "env"
    assert detect_launcher({**ranks, "TORCHELASTIC_RUN_ID": "1"}) == "torchrun"
    assert detect_launcher({**ranks, "CROSS_RANK": "0"}) == "deepspeed"
    assert detect_launcher({"OMPI_COMM_WORLD_SIZE": "4"}) == "mpi"
    with pytest.raises(ConfigError, match=r"\['RANK'\] set but \['WORLD_SIZE', 'LOCAL_RANK'\] missing"):
        detect_launcher({"RANK": "0"})


_STALL = """
import time
from disagmoe_ds.launch.watchdog import StallWatch
watch = StallWatch({seconds})
for _ in range({ticks}):
    watch.tick()
    time.sleep(0.05)
def stalled_wait():
    time.sleep({stall})
stalled_wait()
watch.stop()
time.sleep(0.5)  # a stopped watch never fires
"""


@pytest.mark.serial
@pytest.mark.parametrize(("ticks", "stall", "fires"), [(20, 1.5, True), (20, 0.0, False)])
def test_stall_watch_prints_the_stalled_stack_once(ticks, stall, fires):
    """Steady progress (ticks every 50 ms for 1 s, period 0.4 s) never fires; a 1.5 s stall prints the stack."""
    code = _STALL.format(seconds=0.4, ticks=ticks, stall=stall)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert ("stalled_wait" in out.stderr) == fires, out.stderr
    assert out.stderr.count("Timeout (") == int(fires)


def test_free_port_keeps_to_its_range_and_skips_a_taken_port(monkeypatch) -> None:
    """DISAGMOE_PORT_RANGE (one range per xdist worker, tests/conftest.py): every pick lies in it, a bound port is
    never picked, a range with no free port and a malformed one are refused by name."""
    import socket

    from disagmoe_ds.launch.local import PORT_RANGE_ENV, free_port

    def bindable(port: int) -> bool:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                return False
            return True

    # Two free neighbours below the kernel's ephemeral ports and the workers' ranges (20000-28999).
    taken = next(port for port in range(15000, 16000, 2) if bindable(port) and bindable(port + 1))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", taken))
        monkeypatch.setenv(PORT_RANGE_ENV, f"{taken}-{taken + 1}")
        assert {free_port() for _ in range(20)} == {taken + 1}
        monkeypatch.setenv(PORT_RANGE_ENV, f"{taken}-{taken}")
        with pytest.raises(RuntimeError, match=f"no free port in {PORT_RANGE_ENV}={taken}-{taken}"):
            free_port()
    monkeypatch.setenv(PORT_RANGE_ENV, "20000")
    with pytest.raises(ValueError, match="must be LO-HI"):
        free_port()
