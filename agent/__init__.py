"""Agent: the process on each GPU node that starts and stops engine shards."""
