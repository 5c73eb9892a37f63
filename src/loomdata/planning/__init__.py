"""The global planner: mixture schedule -> step membership -> packing -> cost-balanced slots -> plan dir.

`make_plan(spec)` writes `workdir/plans/<plan_id>/` (plan.json, manifest/ partitions, report/);
`plan_report` and `plot_plan` read a stored plan back. Modules, one job each: _mixture (step
membership), _packing (lanes, segments, the baseline packer), _balance (slot assignment), _cost (the
cost model), _manifest (partitioned writer), _report (figures, summary, plot), _plan (orchestration).
"""

from loomdata.planning._cost import segment_cost
from loomdata.planning._plan import PlanResult, make_plan
from loomdata.planning._report import plan_report, plot_plan

__all__ = ["PlanResult", "make_plan", "plan_report", "plot_plan", "segment_cost"]
