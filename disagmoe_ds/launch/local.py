"""Run a function on a small job of ranks forked from this process (tests, disagmoe-verify, no-launcher runs).

Each rank is a ``fork`` child: it inherits the parent's imports (torch, deepspeed: ~5 s saved per rank), so
starting a rank costs ~0.3 s (where this process has initialised CUDA, which a forked child could not use, the ranks
are spawned instead). The parent watches every child and fails fast: the first rank that raises or
dies ends the job, and a job that outlives its timeout is killed with a stack dump of every live rank.

Results travel as plain pickles through a pipe (not through ``multiprocessing`` queues, whose torch
reducers hand tensors over as shared-memory handles that break once the child exits), so a rank may return
tensors as long as they are on the CPU.
"""

from __future__ import annotations

import faulthandler
import functools
import math
import multiprocessing as mp
import os
import pickle
import secrets
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.context import ForkContext, SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from disagmoe_ds.launch.env import disable_shm_op, init_from_env, preload_engine_imports

# After the first failure, how long to keep listening for other ranks' reports: a rank that died often
# makes its peers fail too, and the root cause may arrive a moment after the first report.
_GRACE_S = 0.25
# How long a rank gets to write its stack dump (faulthandler writes from its C signal handler).
_DUMP_WAIT_S = 0.3
_DUMP_SIGNAL = signal.SIGUSR1


class RankFailedError(RuntimeError):
    """A rank of a local job raised or died; ``rank`` is the first one that failed (the root cause).

    ``cause`` is that rank's failure in one line (its exception's last line, or how it died); the message holds
    every failed rank's full traceback.
    """

    def __init__(self, rank: int, message: str, cause: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.cause = cause or message.splitlines()[0]


@dataclass
class _Child:
    """The parent's view of one rank."""

    rank: int
    process: BaseProcess
    conn: Connection  # read end of the rank's result pipe
    stack_path: str
    reported: bool = False
    status: str = ""  # "ok" or "error" once reported
    value: Any = None  # return value ("ok") or traceback text ("error")
    failed_at: float = 0.0  # time.monotonic() of the raise (reported by the rank; one clock per machine)
    exited: bool = False


def spawn_local(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout_s: float | None = 120.0,
    comm_timeout_s: float | None = None,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` forked ranks and return the results in rank order.

    Each rank gets MASTER_ADDR/MASTER_PORT/RANK/LOCAL_RANK/WORLD_SIZE/LOCAL_SIZE (plus ``env``), initialises
    torch.distributed through ``init_from_env`` exactly as a launched process would, runs ``fn``, then
    passes a barrier and destroys its process group. With a device backend (nccl) the parent must not have
    initialised CUDA before the fork; each rank binds device LOCAL_RANK.

    Args:
        fn: called as ``fn(rank, *args)``; its return value must pickle (CPU tensors are fine).
        world_size: number of ranks.
        args: extra positional arguments; inherited through fork, so they need not pickle.
        timeout_s: wall-clock limit for the whole job; None for none (a training run started without a
            launcher), where only a failing rank ends the job early.
        backend: torch.distributed backend.
        comm_timeout_s: per-operation timeout of every process group (see ``init_from_env``).
        env: extra environment variables for every rank.

    Returns:
        ``[fn(0, *args), fn(1, *args), ...]``.

    Raises:
        RankFailedError: a rank raised (its traceback is in the message) or exited without a result; the
            other ranks are killed at once.
        TimeoutError: the job ran past ``timeout_s``; names the ranks still inside ``fn`` and shows their stacks.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    # DeepSpeed probes its ops (compiling a test program per op) on first look; probe once here, not per rank.
    disable_shm_op()
    preload_engine_imports()  # and what each rank's engine would import: once here, inherited through fork
    for attempt in range(_PORT_ATTEMPTS):
        try:
            return _spawn_once(fn, world_size, args, timeout_s, backend, comm_timeout_s, env)
        except RankFailedError as err:
            # The free port we picked was taken by another process before rank 0 bound it: nothing ran yet.
            if "EADDRINUSE" not in str(err) or attempt == _PORT_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


_PORT_ATTEMPTS = 3


def _spawn_once(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any],
    timeout_s: float | None,
    backend: str,
    comm_timeout_s: float | None,
    env: dict[str, str] | None,
) -> list[Any]:
    base_env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world_size),
        "LOCAL_SIZE": str(world_size),
        **(env or {}),
    }
    # A forked child cannot use CUDA once this process has initialised it, which an import may do: transformers
    # imports torchao where it is installed, and torchao asks torch whether Triton runs on the device. Then the ranks
    # are spawned: each imports everything again (seconds a rank), and ``fn`` and ``args`` must pickle.
    ctx = mp.get_context("spawn") if torch.cuda.is_initialized() else mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="disagmoe-ranks-") as stack_dir:
        children = []
        try:
            for rank in range(world_size):
                init = functools.partial(init_from_env, backend, comm_timeout_s=comm_timeout_s)
                children.append(_start(ctx, fn, rank, args, base_env, init, stack_dir))
            _watch(children, timeout_s)
        finally:
            _kill(children)
    return [child.value for child in children]


# "LO-HI": rendezvous ports come from this range only. The test suite gives each of its parallel workers its own range
# below the ephemeral ports, so two workers' jobs never pick the same port.
PORT_RANGE_ENV = "DISAGMOE_PORT_RANGE"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now: the kernel's pick, or one of ``$DISAGMOE_PORT_RANGE`` (tried from a
    random start). Another process could take it before rank 0 binds it (then rank 0 fails loudly)."""
    span = os.environ.get(PORT_RANGE_ENV)
    if not span:
        return _bind_free(0)
    try:
        lo, hi = (int(end) for end in span.split("-"))
    except ValueError:
        raise ValueError(f"{PORT_RANGE_ENV}={span!r} must be LO-HI, two port numbers") from None
    if not 0 < lo <= hi < 65536:
        raise ValueError(f"{PORT_RANGE_ENV}={span!r} must be LO-HI with 0 < LO <= HI < 65536")
    start = secrets.randbelow(hi - lo + 1)  # not the random module: a test may have seeded it
    for i in range(hi - lo + 1):
        try:
            return _bind_free(lo + (start + i) % (hi - lo + 1))
        except OSError:  # taken (or in TIME_WAIT from an earlier job)
            continue
    raise RuntimeError(f"no free port in {PORT_RANGE_ENV}={span}")


def _bind_free(port: int) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
        return int(sock.getsockname()[1])


def _start(
    ctx: ForkContext | SpawnContext,
    fn: Callable[..., Any],
    rank: int,
    args: Sequence[Any],
    base_env: dict[str, str],
    init: Callable[[], None],
    stack_dir: str,
) -> _Child:
    reader, writer = ctx.Pipe(duplex=False)
    stack_path = os.path.join(stack_dir, f"rank{rank}.stack")
    rank_env = {**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
    process = ctx.Process(
        target=_rank_main,
        args=(fn, rank, tuple(args), rank_env, init, writer, stack_path),
        name=f"rank{rank}",
    )
    process.start()
    writer.close()  # the child holds the write end now
    return _Child(rank=rank, process=process, conn=reader, stack_path=stack_path)


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    args: tuple[Any, ...],
    rank_env: dict[str, str],
    init: Callable[[], None],
    conn: Connection,
    stack_path: str,
) -> None:
    """Body of one rank: init, run, report, tear down."""
    os.environ.update(rank_env)
    stack_file = open(stack_path, "w")  # stays open: faulthandler writes to it on _DUMP_SIGNAL
    faulthandler.register(_DUMP_SIGNAL, file=stack_file, all_threads=True)
    _single_thread()
    try:
        init()  # init_from_env with the job's backend and timeout
        message = pickle.dumps(("ok", fn(rank, *args)))
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", (time.monotonic(), traceback.format_exc()))))
        # No teardown barrier: the parent is about to kill the peers, which would never reach it.
        sys.exit(1)
    conn.send_bytes(message)
    dist.barrier()
    dist.destroy_process_group()


def _single_thread() -> None:
    # One intra-op thread per forked rank (torchrun sets OMP_NUM_THREADS=1 for the same reason): ranks share
    # the cores, and a child forked from a parent whose OpenMP pool already ran can hang when it starts a pool
    # of several threads. An explicit OMP_NUM_THREADS wins.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def _watch(children: list[_Child], timeout_s: float | None) -> None:
    """Wait until every rank reported and exited; raise on the first failure or at the deadline."""
    deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
    while not all(child.exited for child in children):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _timeout_error(children, timeout_s)
        _poll(children, None if remaining == math.inf else remaining)
        if any(_has_failed(child) for child in children):
            _absorb_until(children, time.monotonic() + _GRACE_S)
            raise _failure_error(children)


def _absorb_until(children: list[_Child], until: float) -> None:
    """Keep collecting reports and exits until ``until`` (or until every rank has exited)."""
    while not all(child.exited for child in children) and (remaining := until - time.monotonic()) > 0:
        _poll(children, remaining)


def _poll(children: list[_Child], timeout: float | None) -> None:
    """Block up to ``timeout`` for a report or an exit, then absorb everything that is ready."""
    by_handle: dict[Any, _Child] = {}
    for child in children:
        if not child.reported:
            by_handle[child.conn] = child
        if not child.exited:
            by_handle[child.process.sentinel] = child
    for handle in wait(list(by_handle), timeout=timeout):
        child = by_handle[handle]
        if handle is child.conn:
            _read_report(child)
        else:
            _read_report(child)  # a report written just before exiting is still in the pipe
            child.process.join()
            child.exited = True


def _read_report(child: _Child) -> None:
    if child.reported or not child.conn.poll():
        return
    try:
        child.status, child.value = pickle.loads(child.conn.recv_bytes())
    except EOFError:  # the rank exited without writing; its exit code tells the story
        return
    child.reported = True
    if child.status == "error":
        child.failed_at, child.value = child.value


def _has_failed(child: _Child) -> bool:
    if child.status == "error":
        return True
    return child.exited and (not child.reported or child.process.exitcode != 0)


def _describe_failure(child: _Child) -> str:
    if child.status == "error":
        return f"rank {child.rank} raised:\n{child.value}"
    code = child.process.exitcode
    how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
    when = "during teardown (after returning)" if child.reported else "before returning a result"
    return f"rank {child.rank} {how} {when}"


def _failure_error(children: list[_Child]) -> RankFailedError:
    failed = [child for child in children if _has_failed(child)]
    # Root cause first. A rank that vanished without a report (os._exit, a signal) did not see a peer fail
    # first, while its peers then raise "connection closed" errors; among ranks that raised, the earliest.
    failed.sort(key=lambda child: (child.status == "error", child.failed_at))
    others = [child.rank for child in children if child not in failed and not child.exited]
    lines = [f"{len(failed)} of {len(children)} ranks failed; killing ranks {others}"]
    lines += [_describe_failure(child) for child in failed]
    return RankFailedError(failed[0].rank, "\n".join(lines), cause=_one_line_cause(failed[0]))


def _one_line_cause(child: _Child) -> str:
    """The root cause in one line: the exception line of the rank's traceback, or how the rank died."""
    if child.status == "error":
        lines = [line for line in child.value.splitlines() if line.strip()]
        return lines[-1] if lines else "raised"
    return _describe_failure(child).removeprefix(f"rank {child.rank} ")


def _timeout_error(children: list[_Child], timeout_s: float | None) -> TimeoutError:
    inside = [child.rank for child in children if not child.reported]
    teardown = [child.rank for child in children if child.reported and not child.exited]
    lines = [
        f"local job of {len(children)} ranks timed out after {timeout_s} s; ranks {inside} were still running "
        f"fn; ranks {teardown} had returned and were waiting in the teardown barrier"
    ]
    lines += _stack_dumps([child for child in children if not child.exited])
    return TimeoutError("\n".join(lines))


def _stack_dumps(children: list[_Child]) -> list[str]:
    for child in children:
        if child.process.pid is not None:  # every child was started; None only before start()
            os.kill(child.process.pid, _DUMP_SIGNAL)
    time.sleep(_DUMP_WAIT_S)
    dumps = []
    for child in children:
        with open(child.stack_path) as f:
            dumps.append(f"--- stack of rank {child.rank} ---\n{f.read().strip()}")
    return dumps


def _kill(children: list[_Child]) -> None:
    for child in children:
        if child.process.is_alive():
            child.process.kill()
    for child in children:
        child.process.join()
        child.conn.close()
