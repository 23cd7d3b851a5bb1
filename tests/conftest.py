"""Shared test settings: hypothesis profiles.

Profiles (``HYPOTHESIS_PROFILE=<name>`` picks one; ``CI`` set forces ``ci``; default ``ci``):

- ``ci``: full example counts (the dense-cache contract suite runs >= 2,000 sequences),
  no deadline. The default, so that the README's test command always runs the full count.
- ``dev``: a quick local pass with a tenth of the examples (``oracle.examples``).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

for _name in ("ci", "dev"):
    settings.register_profile(
        _name, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
    )
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "ci"))
