"""The parts of the asynchronous schedule (see docs/async.md): the job both roles share, tickets,
flight reports, the rollout worker and the trainer worker. `patrl.orchestrator.async_loop`
builds a rank's role and runs it."""
