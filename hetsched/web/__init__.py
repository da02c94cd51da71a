"""Web placement planner: a REST API and one page over the store, the catalog and the optimizer."""

from hetsched.web.app import create_app

__all__ = ["create_app"]
