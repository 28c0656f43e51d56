"""A run that stopped moving: a hung rank ends it (see test_stacks.py); a run in which every rank
stopped at the same point is explained, once, and goes on."""

import re
import time

from nbddp import spawn_train
from nbddp.contract.protocol import Heartbeat
from nbddp.kernel.stall import QuietWatch, find_lagging_rank, where_all_are
from conftest import WORKERS, survivors, wait_for


def beats(*progress, step=5, running=True):
    return {r: Heartbeat(rank=r, state="running" if running else "starting", epoch=0, step=step,
                         progress_time=p, beat_time=100.0) for r, p in enumerate(progress)}


def test_a_quiet_spell_is_told_once_after_the_timeout_and_three_times_the_run_s_longest_gap():
    watch = QuietWatch(stall_timeout_s=10, launched_at=0.0)
    assert watch.quiet_for(beats(None, 1.0), now=50.0) is None  # rank 0 never reported progress
    assert watch.quiet_for(beats(4.0, 4.0), now=13.0) is None  # the launch to the first progress: 4 s
    assert watch.longest_gap_s == 4.0
    assert watch.quiet_for(beats(4.0, 4.0), now=15.0) is None  # 11 s: over 10 s, not over 3 * 4 s
    assert watch.quiet_for(beats(4.0, 4.0), now=17.0) == 13.0  # over both: told
    assert watch.quiet_for(beats(4.0, 4.0), now=40.0) is None  # once per spell
    # Progress again, after a gap of 56 s (a long evaluation): the rhythm is learned.
    assert watch.quiet_for(beats(60.0, 59.0), now=61.0) is None and watch.longest_gap_s == 56.0
    assert watch.quiet_for(beats(60.0, 59.0), now=60.0 + 3 * 56.0 - 1) is None
    assert watch.quiet_for(beats(60.0, 59.0), now=60.0 + 3 * 56.0 + 1) == 3 * 56.0 + 1


def test_only_a_rank_behind_the_others_is_hung():
    ahead = Heartbeat(rank=0, state="running", epoch=0, step=6, progress_time=10.0)
    behind = Heartbeat(rank=1, state="running", epoch=0, step=5, progress_time=10.0)
    assert find_lagging_rank({0: ahead, 1: behind}, now=15.0, stall_timeout_s=10) is None  # not for long yet
    assert find_lagging_rank({0: ahead, 1: behind}, now=21.0, stall_timeout_s=10) == 1
    assert find_lagging_rank(beats(10.0, 10.0), now=1000.0, stall_timeout_s=10) is None  # all at one point
    assert where_all_are(beats(1.0, 2.0)) == " (all at epoch 0, step 5)"
    assert where_all_are({0: ahead, 1: behind}) == ""


def test_a_run_where_every_rank_waits_in_its_data_is_told_where_they_are_and_goes_on(tmp_path, runs_dir):
    """Every rank waits in ``load_batch`` (a data loader on a dead file system): none lags and no
    collective times out, so no rule may end the run; the cell is told where every rank is, once."""
    go, notices = tmp_path / "go", []
    h = spawn_train(f"{WORKERS / 'stuck.py'}:every_rank_stuck", str(go), nprocs=2, runs_dir=runs_dir, block=False,
                    echo=False, stall_timeout_s=2,
                    on_event=lambda kind, payload: notices.append(payload) if kind == "notice" else None)
    try:
        assert wait_for(lambda: notices, 90), "no notice"
        line = notices[0]
        assert re.match(r"nbddp: no rank has made progress for \d+ s \(all at epoch 0, step 4\), and none is behind "
                        r"the others: ", line), line
        for rank in (0, 1):
            assert re.search(rf"rank {rank} is in `load_batch` \(stuck.py:1[23]\)", line), line
        assert line.endswith("The run goes on; Stop (or handle.stop()) ends it."), line
        time.sleep(3)
        assert h.running and len(notices) == 1  # told once; nothing ended
    finally:
        go.write_text("go")
        result = h.wait(timeout=60)
    assert result.value == 2.0 and not result.stopped
    assert survivors(h.pids) == {}


def test_the_panel_shows_the_notice_in_its_log_and_status():
    from nbddp.ui.run_view import RunView

    view = RunView(worker=True, on_idle=lambda: None, plan=(None, None))
    line = "nbddp: no rank has made progress for 120 s, and none is behind the others: rank 0 is in `load_batch` (w.py:3)"
    view._on_event("notice", line)
    assert "<b>No progress</b>: nbddp: no rank has made progress for 120 s" in view.status.value, view.status.value
    assert "jp-warn-color1" in view.status.value
    assert wait_for(lambda: "load_batch" in view.log.value, 5), view.log.value


def test_time_at_a_debugger_prompt_is_no_quiet_spell():
    """A rank sat at a pdb prompt (heartbeats say "debugging"): the handle pauses the quiet watch,
    and the run is judged afresh once the debugger lets the ranks go on."""
    watch = QuietWatch(stall_timeout_s=5, launched_at=0.0)
    beats = {r: Heartbeat(r, state="running", progress_time=1.0) for r in (0, 1)}
    assert watch.quiet_for(beats, 2.0) is None
    watch.pause(60.0)  # at the prompt from 2 s to 60 s
    assert watch.quiet_for(beats, 61.0) is None
    assert watch.quiet_for(beats, 66.0) is not None, "quiet for long after the prompt: told"
