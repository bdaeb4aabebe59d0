"""The ``microbatch`` OpenLineage run facet: the batch a run committed.

Apart from `lineage` because defining it imports OpenLineage's client, which
only a task whose lineage is sent needs.
"""

from __future__ import annotations

from typing import Any

from attrs import define
from openlineage.client.facet_v2 import RunFacet

__all__ = ["MicrobatchRunFacet"]

#: The facet is a RunFacet with the fields below (documented in
#: docs/architecture.md, "Lineage"); it names the base schema it extends.
SCHEMA_URL = "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/RunFacet"


@define
class MicrobatchRunFacet(RunFacet):
    """The batch a run committed (or found already committed, or rewound to)."""

    status: str
    epoch: int | None
    batchId: int | None  # noqa: N815 - OpenLineage facets use camelCase fields
    startOffsets: dict[str, Any] | None  # noqa: N815
    endOffsets: dict[str, Any] | None  # noqa: N815
    recordsIn: int | None  # noqa: N815
    recordsQuarantined: int | None  # noqa: N815
    stateVersion: int | None  # noqa: N815

    @staticmethod
    def _get_schema() -> str:
        return SCHEMA_URL
