"""The endpoint table as the router reads it, from the hub or, in router-only mode, from the command line or a file."""
