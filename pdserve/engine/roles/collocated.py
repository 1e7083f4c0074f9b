"""The collocated role: requests run end to end on this engine; nothing crosses a link."""

from __future__ import annotations

from pdserve.engine.roles.base import Role


class CollocatedRole(Role):
    name = "collocated"
