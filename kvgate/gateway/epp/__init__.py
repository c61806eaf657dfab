"""``kvgate epp``: fleet mode's routing decision served to Envoy as an endpoint picker.

The Gateway API Inference Extension's endpoint picker protocol over Envoy's ext_proc v3: Envoy
sends each request's headers and body, the picker names the upstream (header
``x-gateway-destination-endpoint`` and dynamic metadata ``envoy.lb``), and Envoy relays the
bytes itself through an ``ORIGINAL_DST`` cluster. The decision is the fleet's own
(``Fleet.pick``: ``Fleet.decide`` then ``Chooser.choose``), so a key lands where a fleet
gateway would send it. The parts: ``bodies`` (a body read as the doors read it), ``picker``
(the decision as an endpoint or a refusal), ``messages`` (the ext_proc answers), ``exchange``
(one stream, either body mode), ``endpoints`` (the members file), ``server`` (gRPC, health,
bounds).
"""
