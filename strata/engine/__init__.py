"""The engine: requests, the scheduler loop, batches and the model runner.

A request's path: `Req` (request.py) -> `Scheduler.schedule` builds a `ScheduleBatch` (batch.py)
-> `ModelRunner` turns it into a `ForwardBatch` of tensors, runs the model and the sampler ->
`Scheduler` appends tokens, finishes requests, and returns `RequestOutput`s. The scheduler decides
by policy.py and chunking.py (torch-free; the planner's simulated replica uses them too).
`Engine` (engine.py) is the offline API over the scheduler. This package never imports FastAPI or
anything HTTP.
"""
