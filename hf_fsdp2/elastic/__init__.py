"""Runs that finish by themselves under torch's elastic agent (docs/restarts.md): the launch's restarts and where an
attempt resumes (:mod:`.agent`), where this rank is in the run (:mod:`.progress`), how each attempt ended and the
run's restarts (:mod:`.attempts`), the hang watchdog (:mod:`.watchdog`), preemption
inside the kill window (:mod:`.kill_window`)."""
