"""The actor runtime: plans of actors joined by registers, run with req / ack messages.

`Plan` / `ActorSpec` / `Input` describe what each rank runs (`sbpflow.runtime.specs`);
`Runtime(plan).run(micro_batches)` runs this rank's actors (`sbpflow.runtime.engine`);
`pipeline_plan` builds a linear pipeline whose schedule (GPipe, 1F1B) is a register budget
(`sbpflow.runtime.schedules`); `save_trace` / `save_timeline` draw the firings
(`sbpflow.runtime.timeline`). See docs/runtime.md, 'Actors and registers'.
"""

from .engine import Runtime
from .schedules import activation_slots, pipeline_plan
from .specs import KINDS, QUEUES, ActorSpec, Input, Plan
from .timeline import in_flight, save_timeline, save_trace

__all__ = ["Runtime", "Plan", "ActorSpec", "Input", "KINDS", "QUEUES", "pipeline_plan",
           "activation_slots", "save_trace", "save_timeline", "in_flight"]
