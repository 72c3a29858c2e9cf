"""loraplex node agent: the daemon (register, heartbeat, pull placements), the launchers of
executors (worker.runner, worker.host) and the spool + forwarder of their reports. The training
itself is in trainer/. Kept light: import submodules explicitly."""
