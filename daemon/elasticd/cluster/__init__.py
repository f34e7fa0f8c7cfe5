"""The cluster as this node sees it: the node registry in the store (records, heartbeats, the
observer's duty and feed), the heartbeat loop, this node's inventory, host discovery, and
daemon-to-daemon requests (peers)."""
