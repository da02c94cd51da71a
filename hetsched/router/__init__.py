"""The router: an OpenAI-compatible gateway that picks an endpoint per request.

Pure decision logic (``policy.decide``, ``predict.predict``, ``health``,
``signals``, ``discovery.endpoints_from_pods``) under a thin ASGI shell
(``app.create_router_app``).
"""

from hetsched.router.config import RouterConfig, load_router_config, parse_router_config
from hetsched.router.policy import decide
from hetsched.router.predict import EndpointProfile, predict
from hetsched.router.types import (DecisionReason, Endpoint, EndpointView, EngineSignals, Policy, Prediction,
                                   RouteRequest, RoutingDecision)

__all__ = ["DecisionReason", "Endpoint", "EndpointProfile", "EndpointView", "EngineSignals", "Policy", "Prediction",
           "RouteRequest", "RouterConfig", "RoutingDecision", "decide", "load_router_config", "parse_router_config",
           "predict"]
