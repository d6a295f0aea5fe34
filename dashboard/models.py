"""The dashboard owns no tables: it renders the cluster summary."""
