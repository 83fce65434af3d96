"""The parts of the asynchronous schedule (docs/async.md): what both roles share (`job`),
`tickets`, `flight_reports`, rank 0's `validation`, the `rollout_worker` and the
`trainer_worker`. `patrl.orchestrator.async_loop` builds a rank's role and runs it."""
