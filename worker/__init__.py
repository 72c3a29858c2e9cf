"""loraplex node agent: the daemon (register, heartbeat, pull placements), the launcher of
executors (worker.runner) and the spool + forwarder of their reports. The training itself is
in trainer/. Kept light: import submodules explicitly."""
