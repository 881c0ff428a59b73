"""The ground: errors, the process world, comm_log, the cross-rank check mode, torch internals."""
