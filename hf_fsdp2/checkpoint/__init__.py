"""Checkpoints of a run, one concern per module (import from the module; this package re-exports nothing):

- :mod:`.layout`: the folder a checkpoint is, its file names, :class:`~.layout.TrainerState`, ``CheckpointError``
- :mod:`.manifest`: per-file digests (``manifest.json``), written at save time and checked before any use
- :mod:`.resume`: run identity, listing, checks of the files, which checkpoint a resume continues from
- :mod:`.checkpointer`: the sharded, atomic save and the load (:class:`~.checkpointer.Checkpointer`)
- :mod:`.space`: the disk space checkpoints and the export take, checked before the first step
- :mod:`.preemption`: SIGTERM turned into "checkpoint and stop" (:class:`~.preemption.StopRequest`)
- :mod:`.run_dir`: the run folder: one run owns it, a previous run is never overwritten by accident
"""
