"""``geoshard plan optimize``: choose region weights, where each region's data lives and the sync,
from ``geoshard.sim``'s predictions, the cheapest plan (egress USD) that meets the budgets.

``inputs`` holds what the search is given (a base ``SimConfig``, the input plan, the budgets),
``choices`` the sync grid and each region's placements, ``search`` the search and its reasons,
``planfile`` the plan TOML it writes (docs/plan.md, "Choosing a plan").
"""

from geoshard.optimize.choices import Placement, SyncChoice
from geoshard.optimize.inputs import Budgets, OptimizeInputs
from geoshard.optimize.planfile import render_plan, write_plan
from geoshard.optimize.search import BudgetCheck, Candidate, Proposal, optimize

__all__ = [
    "BudgetCheck",
    "Budgets",
    "Candidate",
    "OptimizeInputs",
    "Placement",
    "Proposal",
    "SyncChoice",
    "optimize",
    "render_plan",
    "write_plan",
]
