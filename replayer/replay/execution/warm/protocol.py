"""The warm server's wire protocol version and its defaults.

A leaf: the server, its client and the auto-start all read these, and none
of them imports another for them. Change :data:`PROTOCOL` whenever a frame
changes shape (a client of another version is refused in one line).
"""

PROTOCOL = 1
DEFAULT_IDLE_TIMEOUT_S = 4 * 3600
