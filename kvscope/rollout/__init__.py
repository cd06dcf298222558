"""The guide's rollout method against a real server: workloads to drive it with (a trace-shaped
one: :mod:`kvscope.rollout.trace_workload`)."""
