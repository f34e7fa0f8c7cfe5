"""The job table: this node's registry of job records (the one writer of records and
history), the sqlite history, retention, and the cluster's job table in the store (the
board) with its follower."""
