"""``result.profile``: every rank's profiled steps side by side, and the rank the others wait for.

Each profiling rank wrote a :class:`~nbddp.contract.observe.ProfileRecord` (:mod:`nbddp.rank.profiling`):
its steps' time split into communication, data loading, computation and idle, and its top
operators, read with torch's own ``key_averages`` and the window's events. Here they are put
side by side. A collective ends on every rank when the last one arrives, so the rank that spends
the *least* time in collectives per step is the one the others wait for (the straggler); when
the ranks' communication differs by less than :data:`BALANCED` of a step, none is named.
"""

from __future__ import annotations

import html
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Union

from ..contract import rundir
from ..contract.observe import ProfileRecord, read_profile_records

#: A spread of communication time per step below this fraction of a step names no straggler.
BALANCED = 0.05
_PARTS = (("compute_ms", "compute"), ("comm_ms", "communication"), ("data_ms", "data loading"), ("idle_ms", "idle"))


@dataclass
class ProfileSummary:
    """The profiled ranks of one run (``TrainResult.profile``; the panel shows it for a background run).

    Attributes:
        run_dir: the run folder; the traces are in its ``profile/`` folder.
        ranks: each profiled rank's record, by rank.
        waited_for: the rank the others wait for in collectives, or ``None`` (balanced, or one rank).
        wait_ms: how much longer, per step, the others spend in collectives than ``waited_for`` (mean).
    """

    run_dir: Path
    ranks: Dict[int, ProfileRecord]
    waited_for: Optional[int] = None
    wait_ms: float = 0.0

    def per_step(self, rank: int) -> Dict[str, float]:
        """Rank ``rank``'s milliseconds per profiled step: wall, compute, communication, data loading, idle."""
        r = self.ranks[rank]
        n = max(r.steps, 1)
        return {"wall": r.wall_ms / n, **{label: getattr(r, key) / n for key, label in _PARTS}}

    @property
    def traces(self) -> List[Path]:
        """Every rank's Chrome traces (open them in Perfetto, ui.perfetto.dev, or TensorBoard's profiler view)."""
        return [self.run_dir / t for r in sorted(self.ranks) for t in self.ranks[r].traces]

    def verdict(self) -> str:
        """One sentence: which rank the others wait for, or that none stands out."""
        if len(self.ranks) < 2:
            return "one rank profiled: nothing to compare"
        if self.waited_for is None:
            return "no rank keeps the others waiting: their time in collectives is within 5% of a step"
        return (f"the others wait for rank {self.waited_for}: they spend {self.wait_ms:.1f} ms more per step in "
                f"collectives than rank {self.waited_for} does (it arrives last)")

    def __str__(self) -> str:
        head = f"{'rank':>4} {'steps':>5} {'step ms':>8}" + "".join(f" {label:>14}" for _, label in _PARTS)
        lines = [f"profile of {self.run_dir} (ms per step; % of the step)", head]
        for rank in sorted(self.ranks):
            r, p = self.ranks[rank], self.per_step(rank)
            cells = "".join(f" {p[label]:8.1f} ({_pct(p[label], p['wall']):>3})" for _, label in _PARTS)
            lines.append(f"{rank:>4} {r.steps:>5} {p['wall']:8.1f}{cells}")
        lines.append(self.verdict())
        for rank in sorted(self.ranks):
            ops = ", ".join(f"{o['name']} {o['self_ms']:.1f} ms" for o in self.ranks[rank].top_ops[:5])
            lines.append(f"rank {rank} top operators (self time): {ops or 'none recorded'}")
        lines.append(f"traces: {rundir.profile_dir(self.run_dir)} (Perfetto: ui.perfetto.dev; TensorBoard's profiler "
                     "view)")
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{label}</th>" for _, label in _PARTS)
        rows = []
        for rank in sorted(self.ranks):
            r, p = self.ranks[rank], self.per_step(rank)
            cells = "".join(f"<td>{p[label]:.1f} ({_pct(p[label], p['wall'])})</td>" for _, label in _PARTS)
            ops = "<br>".join(html.escape(f"{o['name']}: {o['self_ms']:.1f} ms × {o['calls']}")
                              for o in r.top_ops[:5])
            mark = " ⏳" if rank == self.waited_for else ""
            rows.append(f"<tr><td>{rank}{mark}</td><td>{r.steps}</td><td>{p['wall']:.1f}</td>{cells}"
                        f"<td style='text-align:left'>{ops}</td></tr>")
        return (f"<div><b>Profile</b> (ms per profiled step) of <code>{html.escape(str(self.run_dir))}</code>"
                f"<table><tr><th>rank</th><th>steps</th><th>step</th>{head}<th>top operators</th></tr>"
                + "".join(rows) + f"</table><p>{html.escape(self.verdict())}</p>"
                f"<p>Traces: <code>{html.escape(str(rundir.profile_dir(self.run_dir)))}</code> (ui.perfetto.dev or "
                "TensorBoard's profiler view)</p></div>")


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.0f}%" if whole > 0 else "-"


def summarize(run_dir: Union[str, os.PathLike], world_size: int) -> Optional[ProfileSummary]:
    """The run's :class:`ProfileSummary`, or ``None`` when no rank wrote a profile record."""
    records = read_profile_records(run_dir, world_size)
    if not records:
        return None
    summary = ProfileSummary(Path(run_dir), records)
    timed = {r: rec.comm_ms / rec.steps for r, rec in records.items() if rec.steps > 0}
    if len(timed) >= 2:
        fastest = min(timed, key=timed.get)
        others = [v for r, v in timed.items() if r != fastest]
        extra = sum(others) / len(others) - timed[fastest]
        step = sum(records[r].wall_ms / records[r].steps for r in timed) / len(timed)
        if step > 0 and extra > BALANCED * step:
            summary.waited_for, summary.wait_ms = fastest, extra
    return summary


__all__ = ["ProfileSummary", "summarize", "BALANCED"]
