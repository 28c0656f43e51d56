"""The staged shutdown's transitions, driven by a fake clock: no process is started."""

import signal

from nbddp.contract.protocol import Heartbeat
from nbddp.kernel.shutdown import Shutdown, Stage, ranks_finishing

GRACE, PATIENCE = 1.0, 300.0


class Ranks:
    """Records the signals sent; ``finishing`` is what the fake ranks say."""

    def __init__(self, finishing: bool = True):
        self.sent, self.finishing = [], finishing

    def kill(self, sig):
        self.sent.append(sig)

    def shutdown(self, reason, now=0.0):
        return Shutdown(reason, now, GRACE, PATIENCE, kill=self.kill, finishing=lambda now, since: self.finishing)


def test_a_failure_sends_sigterm_at_once_then_sigkill_after_grace():
    ranks = Ranks()
    sd = ranks.shutdown("failure", now=10.0)
    assert (sd.stage, ranks.sent) == (Stage.TERM, [signal.SIGTERM])
    assert sd.advance(10.0 + GRACE / 2) is Stage.TERM and ranks.sent == [signal.SIGTERM]
    assert sd.advance(10.0 + GRACE) is Stage.KILL
    assert ranks.sent == [signal.SIGTERM, signal.SIGKILL]
    sd.advance(100.0)
    assert ranks.sent == [signal.SIGTERM, signal.SIGKILL], "SIGKILL is sent once"


def test_a_stop_waits_while_the_ranks_finish_up_to_the_stop_timeout():
    ranks = Ranks(finishing=True)
    sd = ranks.shutdown("stop")
    assert sd.stage is Stage.ASK and ranks.sent == []
    assert sd.advance(PATIENCE - 1) is Stage.ASK and ranks.sent == []
    assert sd.advance(PATIENCE) is Stage.INT and ranks.sent == [signal.SIGINT]
    assert sd.advance(PATIENCE + GRACE) is Stage.TERM and ranks.sent == [signal.SIGINT, signal.SIGTERM]
    assert sd.advance(PATIENCE + 2 * GRACE) is Stage.KILL
    assert ranks.sent == [signal.SIGINT, signal.SIGTERM, signal.SIGKILL]


def test_a_stop_interrupts_ranks_that_are_no_longer_finishing_before_sigterm():
    """Code that never asks ctx.should_stop() gets a KeyboardInterrupt (SIGINT), as Ctrl-C gives,
    grace_s before the SIGTERM: its finally: blocks run."""
    ranks = Ranks(finishing=True)
    sd = ranks.shutdown("interrupt")
    assert sd.advance(5.0) is Stage.ASK
    ranks.finishing = False  # a heartbeat went silent, or nobody asked should_stop within grace
    assert sd.advance(6.0) is Stage.INT and ranks.sent == [signal.SIGINT]
    assert sd.advance(6.0 + GRACE - 0.1) is Stage.INT
    assert sd.advance(6.0 + GRACE) is Stage.TERM and ranks.sent == [signal.SIGINT, signal.SIGTERM]
    assert sd.since == 6.0 + GRACE, "SIGKILL comes grace_s after the SIGTERM, not after the request"
    assert sd.advance(6.0 + 2 * GRACE - 0.1) is Stage.TERM
    assert sd.advance(6.0 + 2 * GRACE) is Stage.KILL


def test_a_second_interrupt_kills_at_once():
    ranks = Ranks()
    sd = ranks.shutdown("interrupt")
    sd.kill_now(0.5)
    assert sd.stage is Stage.KILL and ranks.sent == [signal.SIGKILL]


def beat(rank, beat_time, stopping=False):
    return Heartbeat(rank=rank, pid=100 + rank, state="running", beat_time=beat_time, stopping=stopping)


def test_ranks_are_finishing_within_grace_or_once_one_saw_the_request():
    beats = {0: beat(0, 10.0), 1: beat(1, 10.0)}
    assert ranks_finishing(10.5, 10.0, GRACE, beats, running=[0, 1]), "within grace_s of the request"
    assert not ranks_finishing(11.5, 10.0, GRACE, beats, running=[0, 1]), "nobody asked should_stop"
    beats = {0: beat(0, 11.4, stopping=True), 1: beat(1, 11.4)}
    assert ranks_finishing(11.5, 10.0, GRACE, beats, running=[0, 1]), "rank 0 obeys and both beat"


def test_a_rank_whose_heartbeat_went_silent_is_not_finishing():
    beats = {0: beat(0, 50.0, stopping=True), 1: beat(1, 10.0)}
    assert not ranks_finishing(50.0, 10.0, GRACE, beats, running=[0, 1])
    assert ranks_finishing(50.0, 10.0, GRACE, beats, running=[0]), "an exited rank's old beat does not count"
    assert ranks_finishing(10.0 + GRACE + 1.5, 10.0, GRACE, {0: beat(0, 10.0 + GRACE, stopping=True)}, running=[0, 1]), \
        "a rank with no heartbeat yet is timed from the request"


def test_a_failure_lets_a_checkpoint_being_written_end_first():
    sent, writing = [], {"now": True}
    sd = Shutdown("failure", 0.0, GRACE, PATIENCE, kill=sent.append, finishing=lambda now, since: False,
                  writing=lambda now: writing["now"])
    assert (sd.stage, sent) == (Stage.ASK, []), "no SIGTERM while rank 0 writes last.pt"
    assert sd.advance(5.0) is Stage.ASK and sent == []
    writing["now"] = False  # written (or its heartbeat went silent)
    assert sd.advance(5.5) is Stage.TERM and sent == [signal.SIGTERM]
    assert sd.advance(5.5 + GRACE) is Stage.KILL
    # A write that never ends is cut at stop_timeout_s.
    sent2 = []
    sd = Shutdown("failure", 0.0, GRACE, PATIENCE, kill=sent2.append, finishing=lambda now, since: False,
                  writing=lambda now: True)
    assert sd.advance(PATIENCE) is Stage.TERM and sent2 == [signal.SIGTERM]


def test_a_stop_lets_a_checkpoint_being_written_when_the_sigint_came_end_before_sigterm():
    """A rank holds its KeyboardInterrupt while it writes a checkpoint (ctx.save_checkpoint): no
    SIGTERM cuts that write while its heartbeat says it writes, up to stop_timeout_s."""
    sent, writing = [], {"now": False}
    sd = Shutdown("interrupt", 0.0, GRACE, PATIENCE, kill=sent.append, finishing=lambda now, since: False,
                  writing=lambda now: writing["now"])
    assert sd.advance(0.5) is Stage.INT and sent == [signal.SIGINT]
    writing["now"] = True
    assert sd.advance(0.5 + GRACE) is Stage.INT and sent == [signal.SIGINT]
    assert sd.advance(100.0) is Stage.INT
    writing["now"] = False  # whole: the rank's KeyboardInterrupt ends it, or SIGTERM now does
    assert sd.advance(100.5) is Stage.TERM and sent == [signal.SIGINT, signal.SIGTERM]
    sent2 = []
    sd = Shutdown("stop", 0.0, GRACE, PATIENCE, kill=sent2.append, finishing=lambda now, since: False,
                  writing=lambda now: True)
    sd.advance(0.5)
    assert sd.advance(PATIENCE - 0.1) is Stage.INT
    assert sd.advance(PATIENCE) is Stage.TERM, "a write that never ends is cut at stop_timeout_s"
