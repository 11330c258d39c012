"""Start a process group: N local ranks (spawned here) or the ranks `torchrun` started.

`fn` must be picklable (a module-level function): ranks fork from a forkserver (a clean
process that imported torch once, started on first use; 8 ranks start in well under a second
instead of ~10 s of torch imports on a 2-core machine) or are `spawn`ed, never forked from the
caller, so nothing depends on fork-safety of the parent, and no rank inherits its RNG state:
every random draw a rank must share with its peers takes a seeded generator. Each rank sets `OMP_NUM_THREADS=1` (and `torch.set_num_threads(1)`), so N ranks
on a few CPU cores do not oversubscribe them. Results travel back as bytes pickled with the
standard pickler (not torch's shared-memory reducer), so a rank may exit right after sending.

Design notes: docs/concepts/runtime.md#runtime-launch.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as _dt
import os
import pickle
import queue as _queue
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

__all__ = [
    "RankFailure",
    "choose_backend",
    "device",
    "first_problem",
    "from_rank0",
    "group_timeout",
    "init_from_env",
    "launch",
    "rank",
    "spawn",
    "under_torchrun",
    "world_size",
]

_TIMEOUT = _dt.timedelta(seconds=600)


class RankFailure(RuntimeError):
    """A rank raised, died or timed out; `rank` is the first one that failed (-1: timeout)."""

    def __init__(self, message: str, rank: int = -1):
        super().__init__(message)
        self.rank = rank


# ------------------------------------------------------------------------------ helpers
def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """The number of ranks (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def from_rank0(value: Any) -> Any:
    """Rank 0's (picklable) `value` on every rank (collective)."""
    if world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def first_problem(problem: str | None) -> str | None:
    """The problem of the lowest rank that has one, on every rank; None when none has
    (collective)."""
    if world_size() == 1:
        return problem
    problems: list[str | None] = [None] * world_size()
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p is not None), None)


def group_timeout() -> _dt.timedelta:
    """The timeout this run's groups use; `mesh.py` passes it to every `new_group`."""
    return _TIMEOUT


def choose_backend(world_size: int) -> str:
    """NCCL when this node has a GPU per local rank, gloo otherwise."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def device() -> torch.device:
    """Where this rank's tensors live: `cuda:LOCAL_RANK` under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _quiet_env() -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    torch.set_num_threads(1)


# ------------------------------------------------------------------------------- torchrun
def init_from_env(backend: str | None = None, timeout_s: float = 600) -> None:
    """Initialise from torchrun's environment (single or multi node).

    `torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint host:29500 script.py` sets RANK,
    WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT for every process.
    """
    global _TIMEOUT
    if dist.is_initialized():
        return
    _quiet_env()
    ws = int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", ws))
    backend = backend or choose_backend(local_world)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    _TIMEOUT = _dt.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method="env://", timeout=_TIMEOUT)
    # Tear the group down before the interpreter exits: gloo's threads still running at
    # exit end in std::terminate ("terminate called without an active exception").
    atexit.register(_shutdown)


def _shutdown() -> None:
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.barrier()
            dist.destroy_process_group()


def under_torchrun() -> bool:
    """Is this process a rank torchrun started (its environment names the world)?"""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60,
           backend: str | None = None, init: str = "file") -> list[Any]:
    """`spawn` locally, or run in place under torchrun and all-gather the results.

    Under torchrun `world_size` must equal the torchrun world (checked)."""
    if under_torchrun() and not dist.is_initialized():
        init_from_env(backend, max(timeout_s, 60))
        if dist.get_world_size() != world_size:
            raise RankFailure(
                f"torchrun started {dist.get_world_size()} ranks but {world_size} were asked for",
                dist.get_rank(),
            )
        result = fn(*args)
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, result)
        return gathered
    return spawn(fn, world_size, *args, timeout_s=timeout_s, backend=backend, init=init)


# ----------------------------------------------------------------------------------- spawn
# ------------------------------------------------------------------ dying with the launcher
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with(launcher: int) -> None:
    """Make this rank die with the launcher process `launcher`, however it ends (SIGKILL
    included), on every start method:

    * Linux's parent-death signal (prctl(2) PR_SET_PDEATHSIG = SIGKILL): the kernel kills us
      when our parent exits — the launcher under `spawn`; the forkserver under `forkserver`,
      which itself exits when the launcher's end of its pipe closes;
    * a watch thread (every platform, and for what the signal misses: a parent that died
      before prctl ran, a parent that is not the launcher): once a second, if our parent
      changed (we were re-parented) or the launcher is gone, SIGKILL ourselves."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    def gone() -> bool:
        if os.getppid() != parent:
            return True
        try:
            os.kill(launcher, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False

    def watch() -> None:
        while not gone():
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    if gone():  # the launcher died before we got here
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, name="shardwise-launcher-watch", daemon=True).start()


def _worker(local_rank: int, n: int, init_method: str, backend: str, timeout_s: float,
            fn: Callable[..., Any], args: tuple[Any, ...], results: Any,
            launcher: int | None = None) -> None:
    """One rank: init the group, run `fn`, send ("ok", pickled result) or ("error", text)."""
    global _TIMEOUT
    if launcher is not None:
        _die_with(launcher)
    _quiet_env()
    status, payload = "ok", b""
    try:
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        _TIMEOUT = _dt.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, init_method=init_method, rank=local_rank,
                                world_size=n, timeout=_TIMEOUT)
        payload = pickle.dumps(fn(*args))
    except BaseException as exc:  # everything goes back to the parent
        status = "error"
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        payload = f"{type(exc).__name__}: {exc}\n{text}".encode()
    results.put((local_rank, status, payload))
    if status == "ok":
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    # On error skip destroy (it may block on dead peers); the parent reaps us.
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if status == "ok" else 1)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "(no message)"


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60,
          backend: str | None = None, init: str = "file",
          start_method: str | None = None) -> list[Any]:
    """Run `fn(*args)` on `world_size` local ranks; results in rank order.

    Raises `RankFailure` (a `RuntimeError`) as soon as one rank raises or dies, naming that
    rank and its original message (with its traceback), or when `timeout_s` passes; every
    remaining process is terminated first. `timeout_s` is also the process-group timeout, so
    a survivor blocked on a dead peer errors out by itself as well.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be ≥ 1, got {world_size}")
    backend = backend or choose_backend(world_size)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # children inherit it
    ctx = _context(start_method)
    results = ctx.Queue()
    tmpdir = tempfile.mkdtemp(prefix="shardwise-")
    if init == "file":
        init_method = "file://" + os.path.join(tmpdir, "rendezvous")
    elif init == "tcp":
        init_method = f"tcp://127.0.0.1:{_free_port()}"
    else:
        raise ValueError(f"init must be 'file' or 'tcp', got {init!r}")
    old_omp = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the children before torch loads
    procs = []
    try:
        for r in range(world_size):
            p = ctx.Process(target=_worker, daemon=True, name=f"shardwise-rank{r}",
                            args=(r, world_size, init_method, backend, timeout_s, fn, args,
                                  results, os.getpid()))
            p.start()
            procs.append(p)
        return _collect(procs, results, timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(2)
            if p.is_alive():
                p.kill()
                p.join(2)
        results.close()
        results.cancel_join_thread()
        if old_omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old_omp
        shutil.rmtree(tmpdir, ignore_errors=True)


_PRELOAD = ["torch", "torch.distributed", "shardwise.runtime.collectives"]


def _context(start_method: str | None) -> Any:
    """`forkserver` (default where available): ranks fork from a server that imported torch
    once (seconds faster per rank on small machines). `spawn`: a fresh interpreter per rank
    (the fallback where forkserver does not exist, e.g. Windows).
    `SHARDWISE_START_METHOD` overrides the default."""
    default = "forkserver" if "forkserver" in tmp.get_all_start_methods() else "spawn"
    method = start_method or os.environ.get("SHARDWISE_START_METHOD", default)
    if method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {method!r}")
    ctx = tmp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _collect(procs: list[Any], results: Any, timeout_s: float) -> list[Any]:
    n = len(procs)
    # Starting interpreters is not the ranks' fault: allow a few seconds per rank for it.
    deadline = time.monotonic() + timeout_s + 5 + 2 * n
    done: dict[int, Any] = {}
    dead_since: dict[int, float] = {}
    while len(done) < n:
        try:
            r, status, payload = results.get(timeout=0.05)
        except _queue.Empty:
            pass
        else:
            if status == "error":
                _fail(r, payload.decode(), results, procs, done)
            done[r] = pickle.loads(payload)
            continue
        now = time.monotonic()
        for r, p in enumerate(procs):
            if r in done or p.exitcode is None:
                continue
            # Exited without a message: give the queue a moment to deliver one.
            first = dead_since.setdefault(r, now)
            if now - first > 1.0:
                raise RankFailure(f"rank {r} died (exit code {p.exitcode}) without reporting "
                                  "a result", r)
        if now > deadline:
            missing = [r for r in range(n) if r not in done]
            states = ", ".join(f"rank {r}: {_state(procs[r].pid)}" for r in missing)
            raise RankFailure(f"timed out after {timeout_s:g} s waiting for ranks {missing} "
                              f"({states})", missing[0] if len(missing) == 1 else -1)
    return [done[r] for r in range(n)]


_CONSEQUENCES = ("Connection closed by peer", "Connection reset", "Broken pipe", "Timed out",
                 "timed out", "Socket Timeout")


def _state(pid: int | None) -> str:
    """A process's state in words, from /proc/PID/stat (Linux), e.g. "stopped (SIGSTOP)"."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            code = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return "alive, not answering"
    return {"T": "stopped (SIGSTOP or SIGTSTP)", "t": "stopped by a debugger",
            "D": "blocked in uninterruptible I/O", "Z": "exited (zombie)",
            "R": "running, not answering", "S": "sleeping, not answering"}.get(code, code)


def _fail(r: int, text: str, results: Any, procs: list[Any], done: dict[int, Any]) -> None:
    """Raise for the rank that caused the failure.

    After the first error, wait briefly for the others: a peer that died silently (killed,
    `os._exit`) or raised on its own is the cause; "connection closed by peer" and timeouts
    on the survivors are consequences.
    """
    errors = {r: text}
    end = time.monotonic() + 0.5
    while time.monotonic() < end:
        try:
            r2, status, payload = results.get(timeout=0.05)
        except _queue.Empty:
            continue
        if status == "error":
            errors[r2] = payload.decode()
    dead = {q: p.exitcode for q, p in enumerate(procs)
            if q not in errors and q not in done and p.exitcode not in (None, 0)}
    if dead:
        q = min(dead)
        rest = "; ".join(f"rank {k}: {_first_line(v)}" for k, v in errors.items())
        raise RankFailure(f"rank {q} died (exit code {dead[q]}) without reporting a result"
                          f"\nother ranks: {rest}", q)
    causes = [k for k, v in errors.items() if not any(c in v for c in _CONSEQUENCES)]
    silent = [q for q, p in enumerate(procs) if q not in errors and q not in done
              and p.exitcode is None]
    if not causes and silent:  # the survivors timed out waiting for a rank that said nothing
        q = silent[0]
        rest = "; ".join(f"rank {k}: {_first_line(v)}" for k, v in errors.items())
        raise RankFailure(f"rank {q} stopped responding ({_state(procs[q].pid)}); the others "
                          f"timed out waiting for it\nother ranks: {rest}", q)
    first = causes[0] if causes else r
    others = [f"rank {k}: {_first_line(v)}" for k, v in errors.items()
              if k != first and _first_line(v) != _first_line(errors[first])]  # not the same
    tail = ("\nother ranks: " + "; ".join(others)) if others else ""
    raise RankFailure(f"rank {first} failed: {_first_line(errors[first])}{tail}\n"
                      f"--- rank {first} traceback:\n{errors[first]}", first)
