"""The agent owns no tables: it runs on the GPU nodes."""
