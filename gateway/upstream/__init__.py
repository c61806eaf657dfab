"""Fleet mode: kvgate as the gateway for engine servers on other machines."""

from gateway.upstream.fleet import Fleet, FleetConfigError, UpstreamError

__all__ = ["Fleet", "FleetConfigError", "UpstreamError"]
