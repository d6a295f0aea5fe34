"""Catalog: the models operators serve, their aliases and deployment profiles."""
