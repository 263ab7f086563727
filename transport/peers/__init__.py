"""The other peers: their records in the store (directory.py), the connections to each
incarnation (conn.py) and their table (table.py), when a heartbeat is too old (liveness.py), and
whose the notifications are that arrive without a secret (senders.py)."""
