"""Fleet mode: kvgate as the gateway for engine servers on other machines."""

from gateway.upstream.call import UpstreamError
from gateway.upstream.fleet import Fleet, FleetConfigError

__all__ = ["Fleet", "FleetConfigError", "UpstreamError"]
