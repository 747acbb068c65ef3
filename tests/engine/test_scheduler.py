"""The scheduler's order: normal batches first come first served, long ones taking turns a unit at a time, a short
batch never behind more than one long unit, long work never starved, and at most one long unit ahead on a device."""

from __future__ import annotations

from dataclasses import dataclass

from kev_backend.engine.scheduler import Scheduler


@dataclass(eq=False)
class Batch:
    name: str
    units: int
    long: bool = False


def run(scheduler: Scheduler[Batch], arrivals: dict[int, list[Batch]] | None = None, steps: int = 100) -> list[str]:
    """Drives the scheduler like the model thread: `arrivals[k]` join before the k-th choice. The names of the
    batches whose units ran, in order."""
    order: list[str] = []
    for k in range(steps):
        for batch in (arrivals or {}).get(k, []):
            scheduler.add(batch)
        batch = scheduler.next()
        if batch is None:
            break
        assert scheduler.next() is batch  # asking twice chooses the same
        order.append(batch.name)
        scheduler.ran(batch)
        batch.units -= 1
        if batch.units == 0:
            scheduler.finished(batch)
    return order


def test_normal_batches_run_in_order_each_to_its_end() -> None:
    scheduler: Scheduler[Batch] = Scheduler()
    for name, units in (("a", 2), ("b", 1), ("c", 3)):
        scheduler.add(Batch(name, units))
    assert run(scheduler) == ["a", "a", "b", "c", "c", "c"]


def test_long_batches_take_turns() -> None:
    scheduler: Scheduler[Batch] = Scheduler()
    scheduler.add(Batch("x", 3, long=True))
    scheduler.add(Batch("y", 2, long=True))
    assert run(scheduler) == ["x", "y", "x", "y", "x"]


def test_waiting_normal_work_goes_before_a_new_long_batch() -> None:
    scheduler: Scheduler[Batch] = Scheduler()
    scheduler.add(Batch("a", 2))
    scheduler.add(Batch("x", 2, long=True))
    assert run(scheduler) == ["a", "a", "x", "x"]


def test_a_short_batch_waits_for_at_most_one_long_unit() -> None:
    scheduler: Scheduler[Batch] = Scheduler()
    scheduler.add(Batch("x", 5, long=True))
    arrivals = {1: [Batch("a", 1)], 3: [Batch("b", 2), Batch("c", 1)]}
    assert run(scheduler, arrivals) == ["x", "a", "x", "b", "b", "c", "x", "x", "x"]


def test_long_work_gets_a_turn_however_much_normal_work_arrives() -> None:
    """A new normal batch before every choice: after each long unit only the normal batches waiting by then run."""
    scheduler: Scheduler[Batch] = Scheduler()
    scheduler.add(Batch("x", 3, long=True))
    arrivals = {k: [Batch(f"n{k}", 1)] for k in range(1, 30)}
    order = run(scheduler, arrivals, steps=30)
    assert order.count("x") == 3, order
    turns = [i for i, name in enumerate(order) if name == "x"]
    assert turns[0] == 0 and all(b - a - 1 <= 2 for a, b in zip(turns, turns[1:])), order


def test_a_long_unit_waits_for_the_one_before_it_on_the_device() -> None:
    scheduler: Scheduler[Batch] = Scheduler()
    x, a = Batch("x", 3, long=True), Batch("a", 1)
    scheduler.add(x)
    assert scheduler.next() is x
    running = [True]
    scheduler.ran(x, lambda: running[0])
    assert scheduler.next() is None  # only long work, its last unit still on the device
    scheduler.add(a)
    assert scheduler.next() is a  # normal work is enqueued meanwhile
    scheduler.ran(a)
    scheduler.finished(a)
    assert scheduler.next() is None
    b = Batch("b", 1)
    scheduler.add(b)  # came while x's unit ran on the device, after a's turn
    running[0] = False
    assert scheduler.next() is b and scheduler.next() is b  # its turn comes first, and asking twice is the same
    scheduler.ran(b)
    scheduler.finished(b)
    assert scheduler.next() is x


def test_a_batch_on_its_way_gets_the_turn_before_the_next_long_unit() -> None:
    """The caller hands over the batch it formed from the requests that queued during a long unit just after that
    unit's normal round ran out: granted, it runs before the next long unit; without the grant it would wait for it."""
    scheduler: Scheduler[Batch] = Scheduler()
    x, a, b = Batch("x", 3, long=True), Batch("a", 1), Batch("b", 1)
    scheduler.add(x)
    order = run(scheduler, {1: [a]}, steps=2)  # x, then a (waiting after x's unit)
    assert order == ["x", "a"] and scheduler.next() is x
    scheduler.add(b)
    assert scheduler.next() is x  # b arrived after the round: it would wait for x's unit
    scheduler.grant()
    assert scheduler.next() is b
