"""What a run needs around the step: data loaders, Orbax checkpoints, the distributed runtime
and the local multi-process launcher."""
