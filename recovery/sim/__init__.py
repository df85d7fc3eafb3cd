"""The discrete-event simulator: policies compared on a simulated fleet, under the same workload and faults.

No Django here: the simulator is built from workers' catalog and engine core and recovery/policy, so an
experiment runs on a laptop in seconds and gives the same answer for the same seed. This package holds its
inputs so far:

- `workload`: requests, from Poisson or Gamma arrivals with lengths drawn from published statistics of the
  Splitwise (Azure 2023) and ShareGPT traces, or replayed from a CSV trace in splitwise-sim's format; each with a
  tenant tier drawn from a mix;
- `faults`: scripted faults and faults drawn at a rate per node-day, their outage durations, and the delay
  after which the real system detects each kind;
- `scenario`: the fleet, workload, faults, policies, seeds and duration of one experiment, and optionally the
  throughput objectives degradation follows, read from JSON and refused before any run when it cannot run
  (`errors.ScenarioError` names the field, the row and what is allowed);
- `degradation`: the objectives' settings, and each model's level as the control plane moves it
  (recovery.policy.capacity) and what the gateways refuse by it.

And the simulator itself:

- `fleet`: `Simulation(scenario, policy, seed).run()`, one virtual clock and a heap of events; a
  `workers.core.EngineCore` per node; a gateway that routes, places checkpoint holders and plans recovery with
  recovery/policy's functions called as recovery/gateway calls them; faults from the scenario (crash, hang,
  gpu_lost, rack, sdc) detected after `faults.detect`'s delays (sdc: by its canaries, its requests then moved off
  live and those it served named possibly corrupt), repaired, or replaced by a hot spare; with an objective,
  degradation levels evaluated every 2 s, shedding tiers and cutting the nodes' batch limit;
- `metrics`: each request's TTFT, TPOT, end-to-end latency, stall and recovery path; each run's means and
  percentiles, and document 000's recovery time against the same run without faults; requests shed by tier,
  time at each level and the level timeline; sdc detection delays and possibly corrupt requests;
- `experiment` and `python -m recovery.sim scenario.json [--policy P] [--seed N] [--json out.json]`: every
  policy on every seed, one table row each.
"""
