"""Which phase of an RL run each rank is in, so that a collective that fails says where, and who is late.

gloo's "Timed out waiting 30000ms for recv operation to complete" names neither the phase of the run (switch,
generate, reward, save...) nor the rank that did not arrive. Each rank therefore records, in the c10d store the
process group was created with, every phase it enters and leaves: one ``store.set`` of its key
``mh/phase/<run>/<rank>`` to ``"<events> <kind> <label>"``, ``events`` counting the phase entries and exits this
rank has made. Every rank goes through the same phases in the same order, so a rank whose count is below this
rank's has not arrived where this rank waits, and its record says where it is instead ("rank 1 is still in
'reward' of step 3", not "rank 1 passed it"). When a collective inside a phase fails (gloo: a ``RuntimeError``
saying it timed out or lost its peer; any :class:`torch.distributed.DistError`), the phase reads every rank's
record and raises :class:`PhaseTimeout`, chained from the collective's error, naming the phase, its step, the
timeout and the late ranks with the phase each is in. A phase that fails otherwise records it ("failed ... with
ValueError: ...") for the others' messages and re-raises the error unchanged.

Cost: one ``store.set`` per phase entry and one per exit, ~20 µs each on a local TCPStore (the recipe's PPO step
enters ~15 phases: well under a millisecond per step).

Where phases come from: the library functions the recipe calls enter theirs (:func:`recorded`), so an edited recipe
keeps them; :func:`megatron_hybrid.rl.initialize` installs one :class:`PhaseRecorder` per process for its block.
Outside such a block :func:`phase` records nothing. On NCCL, torch's watchdog usually ends the process itself on a
timeout (``TORCH_NCCL_ASYNC_ERROR_HANDLING``), before Python sees an error: then the records stay in the store, but
no message is raised.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import inspect
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, TypeVar

import torch.distributed as dist

F = TypeVar("F", bound=Callable[..., Any])

#: How long the diagnosis waits for the store: the message must not hang on a store that stopped answering.
STORE_TIMEOUT = datetime.timedelta(seconds=10)

# gloo (torch 2.13) raises a bare RuntimeError on a timeout, or when the peer's side of the connection closed (it
# timed out or died first): these are its messages. torch's own errors are DistError subclasses (DistBackendError,
# NCCL's included, DistNetworkError, DistStoreError).
_COLLECTIVE_FAILURES = ("Timed out waiting", "Connection closed by peer", "Connection reset by peer",
                        "Application timeout caused pair closure", "Connect timeout", "Read timeout",
                        "Write timeout", "timed out in monitoredBarrier")

# One recorder after another in a long-lived process (the tests' rank pools) writes keys of its own: ranks create
# their recorders in the same order, so the n-th of each rank shares the n-th namespace and never reads the
# records of an earlier run.
_runs = itertools.count()
_current: Optional["PhaseRecorder"] = None


class PhaseTimeout(RuntimeError):
    """A collective inside a phase of the run timed out or lost its peer; the message names the phase, its step, the
    timeout and the ranks that did not arrive (chained from the collective's own error)."""


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective (or its store) failing rather than the code inside the phase."""
    return isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError) and any(s in str(error) for s in _COLLECTIVE_FAILURES))


def phase_label(names: Sequence[str], step: Optional[int]) -> str:
    """``'train step > reward' (step 3)``: the nested phase names, outermost first, and the step when known."""
    return f"'{' > '.join(names)}'" + ("" if step is None else f" (step {step})")


def _first_line(error: BaseException, *, limit: int = 300) -> str:
    text = str(error).strip().splitlines()
    line = text[0] if text else ""
    return f"{type(error).__name__}: {line[:limit]}{'...' if len(line) > limit else ''}"


def _rank_list(ranks: Sequence[int]) -> str:
    """``rank 3`` / ``ranks 1-4, 7``: consecutive ranks as ranges, for worlds of thousands."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


# What a record's kind says after "rank N" (one rank, several ranks).
_STATES = {"ready": ("has entered no phase yet", "have entered no phase yet"),
           "in": ("is in {}", "are in {}"),
           "after": ("has left {} and entered no phase since", "have left {} and entered no phase since"),
           "failed": ("failed in {}", "failed in {}")}


def _describe(groups: dict[tuple[str, str], list[int]]) -> str:
    parts = []
    for (kind, label), ranks in groups.items():
        one, many = _STATES[kind]
        parts.append(f"{_rank_list(ranks)} {(one if len(ranks) == 1 else many).format(label)}")
    return ", ".join(parts)


def timeout_message(*, phase: str, rank: int, events: int, records: Mapping[int, Optional[str]], timeout: str,
                    error: BaseException, unreadable: Optional[str] = None) -> str:
    """The message of :class:`PhaseTimeout` (a pure function of what the store held).

    ``phase``: this rank's phase (:func:`phase_label`); ``events``: its count of phase entries and exits;
    ``records``: the other ranks' records (``"<events> <kind> <label>"``, ``None`` where a rank wrote none);
    ``timeout``: the timeout and where it is set; ``error``: the collective's error (its first line is quoted);
    ``unreadable``: why the store could not be read (then ``records`` is not used).
    """
    parts = [f"phase {phase} failed on rank {rank} ({_first_line(error)})", f"the timeout is {timeout}"]
    if unreadable is not None:
        return "; ".join(parts + [f"the other ranks' phases could not be read ({unreadable})"])
    late: dict[tuple[str, str], list[int]] = {}
    failed: dict[tuple[str, str], list[int]] = {}
    missing: list[int] = []
    for r, record in sorted(records.items()):
        if record is None:
            missing.append(r)
            continue
        count, kind, label = (record.split(" ", 2) + [""])[:3]
        if kind == "failed":  # whatever its count: the likeliest reason this rank waited in vain
            failed.setdefault((kind, label), []).append(r)
        elif int(count) < events:
            late.setdefault((kind, label), []).append(r)
    if late:
        parts.append(f"did not arrive: {_describe(late)}")
    if failed:
        parts.append(_describe(failed))
    if missing:
        parts.append(f"{_rank_list(missing)} recorded no phase")
    if not (late or failed or missing):
        parts.append("every rank reached this phase (one stalls in it, or the ranks issue different collectives in "
                     "it)")
    return "; ".join(parts)


@dataclass(frozen=True)
class _Phase:
    names: tuple[str, ...]
    step: Optional[int]

    @property
    def label(self) -> str:
        return phase_label(self.names, self.step)


class PhaseRecorder:
    """This rank's phases, recorded in ``store`` (shared by the ``world_size`` ranks) for the others' messages.

    ``timeout``: the process groups' timeout, ``timeout_source`` where it is set (e.g.
    ``"--distributed-timeout-minutes 10"``), both only for the message.
    """

    def __init__(self, store: dist.Store, *, rank: int, world_size: int, timeout: datetime.timedelta,
                 timeout_source: Optional[str] = None) -> None:
        # A client of its own: its short timeout (for the diagnosis) is not the process group's.
        self._store = store.clone()
        self._store.set_timeout(STORE_TIMEOUT)
        self.rank, self.world_size = rank, world_size
        self.timeout = f"{timeout.total_seconds():g} s" + ("" if timeout_source is None else f" ({timeout_source})")
        self._prefix = f"mh/phase/{next(_runs)}/"
        self._events = 0
        self._stack: list[_Phase] = []
        self._failure: Optional[BaseException] = None  # the error the innermost phase recorded: outer ones pass it
        self._write("ready")

    @classmethod
    def for_default_group(cls, *, timeout: datetime.timedelta,
                          timeout_source: Optional[str] = None) -> "PhaseRecorder":
        """A recorder in the store of the default process group (torchrun's env:// store, or the one given to
        ``init_process_group``)."""
        # torch (2.x) keeps the store only in its private world state; the PrefixStore it returns is shared by
        # every rank of the default group.
        store = dist.distributed_c10d._get_default_store()
        return cls(store, rank=dist.get_rank(), world_size=dist.get_world_size(), timeout=timeout,
                   timeout_source=timeout_source)

    def _write(self, kind: str, label: str = "") -> None:
        self._store.set(f"{self._prefix}{self.rank}", f"{self._events} {kind} {label}".rstrip())

    def records(self) -> dict[int, Optional[str]]:
        """Every rank's record (``"<events> <kind> <label>"``; ``None``: none yet). Never waits for a missing key."""
        keys = [f"{self._prefix}{r}" for r in range(self.world_size)]
        if self._store.check(keys):  # the usual case: two round trips for the whole world
            return {r: v.decode() for r, v in enumerate(self._store.multi_get(keys))}
        return {r: self._store.get(k).decode() if self._store.check([k]) else None for r, k in enumerate(keys)}

    @property
    def current(self) -> Optional[str]:
        """This rank's innermost phase (:func:`phase_label`), ``None`` outside any."""
        return self._stack[-1].label if self._stack else None

    @contextlib.contextmanager
    def enter(self, name: str, *, step: Optional[int] = None) -> Iterator[None]:
        """The block is phase ``name`` (inside the enclosing phase, whose step it inherits unless ``step`` is given).
        Enter it on every rank: the ranks' counts are compared."""
        outer = self._stack[-1] if self._stack else None
        here = _Phase((outer.names if outer else ()) + (name,), step if step is not None or outer is None
                      else outer.step)
        self._stack.append(here)
        self._events += 1
        self._write("in", here.label)
        try:
            yield
        except Exception as e:
            if e is self._failure:  # an inner phase recorded (and, for a collective, explained) it
                raise
            if not is_collective_failure(e):
                self._fail(here, e, e)
                raise
            # Read the others' records before writing ours: the diagnosis compares their counts with ours.
            records, unreadable = {}, None
            try:
                records = self.records()
            except RuntimeError as store_error:  # a store that fails now still leaves the phase and the timeout
                unreadable = _first_line(store_error)
            records.pop(self.rank, None)
            error = PhaseTimeout(timeout_message(phase=here.label, rank=self.rank, events=self._events,
                                                 records=records, timeout=self.timeout, error=e,
                                                 unreadable=unreadable))
            self._fail(here, e, error)
            raise error from e
        else:
            self._events += 1
            if outer is None:
                self._write("after", here.label)
            else:
                self._write("in", outer.label)
        finally:
            self._stack.pop()
            if not self._stack:  # a caller that handled the error goes on: do not keep its traceback's frames alive
                self._failure = None

    def _fail(self, here: _Phase, error: BaseException, raised: BaseException) -> None:
        self._failure = raised
        try:
            self._write("failed", f"{here.label} with {_first_line(error, limit=200)}")
        except RuntimeError:  # the store may be what failed: the run's own error must come through, not this one
            pass


def current() -> Optional[PhaseRecorder]:
    """The recorder :func:`recording` installed (``None`` outside one)."""
    return _current


@contextlib.contextmanager
def recording(recorder: PhaseRecorder) -> Iterator[PhaseRecorder]:
    """Install ``recorder`` for :func:`phase` and :func:`recorded` during the block (the previous one after it)."""
    global _current
    previous, _current = _current, recorder
    try:
        yield recorder
    finally:
        _current = previous


def phase(name: str, *, step: Optional[int] = None) -> contextlib.AbstractContextManager[None]:
    """The block is phase ``name`` (of ``step``; default: the enclosing phase's) for the installed recorder; nothing
    without one. Enter it on every rank alike."""
    return contextlib.nullcontext() if _current is None else _current.enter(name, step=step)


def recorded(name: str, *, step: Optional[str] = None) -> Callable[[F], F]:
    """Decorator: every call of the function is phase ``name``; ``step`` names its argument holding the step."""
    def decorate(fn: F) -> F:
        signature = inspect.signature(fn) if step is not None else None

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if _current is None:
                return fn(*args, **kwargs)
            n = None if signature is None else signature.bind(*args, **kwargs).arguments.get(step)
            with _current.enter(name, step=n):
                return fn(*args, **kwargs)
        return wrapper  # type: ignore[return-value]
    return decorate
