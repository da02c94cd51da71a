"""The Gateway API Inference Extension's names on the wire: what hetsched's operator writes (an InferencePool
pointing at an endpoint picker) and its endpoint picker reads and serves on, defined once for both."""

INFERENCE_GROUP = "inference.networking.k8s.io"
INFERENCE_VERSION = "v1"
INFERENCE_POOL_API = f"{INFERENCE_GROUP}/{INFERENCE_VERSION}"
INFERENCE_POOL_PLURAL = "inferencepools"
EPP_PORT = 9002
"""The endpoint picker's ext_proc (gRPC) port, the inference extension's default."""
EPP_HEALTH_PORT = 9003
"""Its gRPC health port (``liveness``, ``readiness``)."""
EPP_METRICS_PORT = 9090
"""Its Prometheus port."""
