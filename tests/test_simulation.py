"""The protocol's state machines at scale, on a simulated network and clock (``benchmarks.simulation``).

Every server is the real ``ServingCore`` and every connection the real ``Link``, exchanging real
encoded messages; time, the network, CPU and the faults are simulated, and one seed fixes a run.
A few seeds run here in seconds; ``python -m benchmarks.simulation --soak`` runs hundreds. Each
check can fail: the last tests take back a fix the simulation found and watch it fail again.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.simulation import Config, run, storm
from benchmarks.simulation.faults import job_restart, partition
from benchmarks.simulation.world import World
from fuelline.server.serving.core import ServingCore
from fuelline.server.serving.session import Session

SMALL = Config(ranks=16, servers=4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", range(4))
def test_every_rank_reads_the_reference_order_through_restarts_partitions_freezes_liars_and_a_job_restart(
    seed: int,
) -> None:
    outcome = run(SMALL, seed)
    assert outcome.faults, "no fault was scheduled"
    assert outcome.violations == [], "\n".join(outcome.faults + outcome.violations)
    assert outcome.finished == SMALL.ranks
    assert outcome.reconnects + outcome.hellos > SMALL.ranks * SMALL.servers  # (the faults were felt)


@pytest.mark.timeout(60)
def test_a_run_leaves_the_callers_logging_as_it_found_it() -> None:
    """The simulation quiets fuelline's loggers while it runs (its reconnects are its point), and
    only then: a program or a test that runs it after logs as before."""
    import logging

    loggers = [logging.getLogger(name) for name in ("fuelline.server", "fuelline.client")]
    loggers[0].setLevel(logging.INFO)
    try:
        run(replace(SMALL, ranks=2, servers=1, epochs=1), 0, faults=False)
        storm(replace(SMALL, ranks=2, servers=1), 0, at=1.0, down=0.5)
        assert [lg.level for lg in loggers] == [logging.INFO, logging.NOTSET]
    finally:
        loggers[0].setLevel(logging.NOTSET)


@pytest.mark.timeout(120)
def test_a_run_is_the_same_for_the_same_seed() -> None:
    a, b = run(SMALL, 7), run(SMALL, 7)
    assert (a.events, a.hellos, a.reconnects, a.simulated) == (b.events, b.hellos, b.reconnects, b.simulated)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("down", [13.3, 21.0, 25.9, 26.6, 27.3])
def test_after_an_outage_of_any_length_every_link_reads_again_soon_after_its_server_is_back(down: float) -> None:
    """A link that noticed silence opens a new socket at once, its Hello waiting there for the
    server: a link that sat out a backoff with its socket closed came back up to 2 s after its
    server did (after these outages, 0.55 to 1.84 s; now 0.10 to 0.34 s)."""
    at, step = 3.0, 0.01
    cfg = Config(ranks=16, servers=2, heartbeat=1.0, step=step, liars=0, epochs=1)
    cfg = replace(cfg, batches=int((at + down + 5.0) / (cfg.servers * step)) + cfg.hwm + 2)
    s = storm(cfg, 0, at, down)
    assert s.outcome.violations == [], "\n".join(s.outcome.violations)
    assert s.time_to_read_again < 0.5, f"the last link read again {s.time_to_read_again:.2f}s after its server was back"


def _partition(world: World) -> list[str]:
    """One trainer host cut off from the only server for less than 3 heartbeats: no one reconnects,
    and what was sent meanwhile, Credits included, is lost."""
    peer = world.ranks[0].peer
    hb = world.cfg.heartbeat
    partition(world, peer, 0, 1.0, 2 * hb)
    return [f"partition {peer} from server 0 at 1.00s for {2 * hb:.2f}s"]


def _job_restart(world: World) -> list[str]:
    job_restart(world, 1.0, 0.1)
    return ["job restart at 1.00s, down 0.10s"]


# One host of 8 ranks, one server; 17 places: 8 of them per address.
ONE_HOST = Config(ranks=8, servers=1, ranks_per_host=8, liars=0, max_clients=17, epochs=2, batches=30, step=0.02)


@pytest.mark.timeout(120)
def test_credit_lost_in_a_partition_is_made_good(monkeypatch: pytest.MonkeyPatch) -> None:
    held = run(ONE_HOST, 1, schedule=_partition)
    assert held.ok, "\n".join(held.violations)
    monkeypatch.setattr(Session, "credit_lost", lambda self, granted: 0)  # (the fix taken back)
    broken = run(ONE_HOST, 1, schedule=_partition)
    assert broken.finished < ONE_HOST.ranks
    assert any("by the end" in v for v in broken.violations), broken.violations


@pytest.mark.timeout(120)
def test_a_job_restarted_at_once_finds_room_beside_its_ghosts(monkeypatch: pytest.MonkeyPatch) -> None:
    held = run(ONE_HOST, 2, schedule=_job_restart)
    assert held.ok, "\n".join(held.violations)
    monkeypatch.setattr(ServingCore, "_gone_found", lambda self, now, keep: False)  # (the fix taken back)
    broken = run(ONE_HOST, 2, schedule=_job_restart)
    assert any("server busy" in v for v in broken.violations), broken.violations


@pytest.mark.timeout(120)
def test_the_checks_see_a_server_that_sends_past_credit(monkeypatch: pytest.MonkeyPatch) -> None:
    grant = Session.grant

    def generous(self: Session, n: int) -> None:
        self.hwm = 1000  # (a server that believes whatever credit it is given)
        grant(self, n)
        self.credit += n

    monkeypatch.setattr(Session, "grant", generous)
    broken = run(replace(ONE_HOST, batches=8), 3, faults=False)
    assert any(v.split(": ", 1)[1].startswith("credit") for v in broken.violations), broken.violations
