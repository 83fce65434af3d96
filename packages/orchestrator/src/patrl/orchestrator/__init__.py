"""patrl.orchestrator: skeleton; its contract is in DESIGN.md and its issue."""

__all__: list[str] = []
