"""The process boundary: the engine core in a process of its own (``core_process``), the
client that talks to it (``core_client``), their wire (``ipc``) and the child's logging."""
