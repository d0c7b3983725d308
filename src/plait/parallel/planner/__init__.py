"""The automatic planner: which plan trains this model fastest within the memory.

It enumerates the plans the world size and the model admit (`enumerate`), measures the
model on this device (`profile`), prices every plan with a memory model and a time model
on the measured network (`price`), and lets short trial runs decide between the best
layouts, metering each one's memory (`trial`). `auto_plan` and `plan_workload` (`auto`)
tie these together and return a `Choice` whose `reason` says why in words and whose
`table` lists every alternative.
"""

from plait.parallel.planner.auto import auto_plan, plan_workload
from plait.parallel.planner.enumerate import candidate_plans, excluded_degrees
from plait.parallel.planner.price import (
    FORWARD_SHARE,
    Choice,
    ComputeProfile,
    Estimate,
    Hardware,
    choose,
    estimate,
    pipeline_time,
)
from plait.parallel.planner.profile import compute_slots, profile_model, tensor_parallel_overhead
from plait.parallel.planner.trial import (
    OPTIMIZER_STATES,
    Trial,
    layouts,
    optimizer_like,
    optimizer_states_of,
    run_trial,
    select,
    shortlist,
    stand_in_optimizer,
)

__all__ = [
    "FORWARD_SHARE",
    "OPTIMIZER_STATES",
    "Choice",
    "ComputeProfile",
    "Estimate",
    "Hardware",
    "Trial",
    "auto_plan",
    "candidate_plans",
    "choose",
    "compute_slots",
    "estimate",
    "excluded_degrees",
    "layouts",
    "optimizer_like",
    "optimizer_states_of",
    "pipeline_time",
    "plan_workload",
    "profile_model",
    "run_trial",
    "select",
    "shortlist",
    "stand_in_optimizer",
    "tensor_parallel_overhead",
]
